//! Reading files a user or another process hands us (profiles, loss traces, statistics files,
//! training logs) without trusting them: only a regular file, opened without blocking, read up
//! to a size limit. A FIFO would block the reader forever, `/dev/zero` would never end.

use std::path::Path;

/// Reads a text file of at most `cap` bytes that must be a regular file: a FIFO would block
/// the reader forever and `/dev/zero` would never end. The file is opened without blocking
/// and checked on the open descriptor, so nothing can be swapped in between. `what` names the
/// file's role in errors ("profile", "trace").
pub fn read_regular_file(path: &Path, cap: u64, what: &str) -> Result<String, String> {
    let (file, meta) = open_regular_file(path, cap, what)?;
    read_opened_file(file, &meta, path, cap, what)
}

/// What [`read_regular_file`] accepts, said in its errors.
fn allowed(what: &str, cap: u64) -> String {
    format!(
        "a {what} must be a regular file of at most {}",
        human_bytes(cap)
    )
}

/// Longest path the system opens (Linux's `PATH_MAX`, 4096 with its NUL).
const MAX_PATH_BYTES: usize = 4095;

/// Refuses a path longer than the system opens, before the system's error (or a loader's)
/// would echo it whole: megabytes, from a profile or a variable, logged by every rank.
pub fn check_path_length(path: &Path) -> Result<(), String> {
    if path.as_os_str().len() > MAX_PATH_BYTES {
        return Err(format!(
            "{}: a path has at most {MAX_PATH_BYTES} bytes",
            crate::error::echo(&path.display().to_string(), str::to_string)
        ));
    }
    Ok(())
}

/// Opens a regular file of at most `cap` bytes, as [`read_regular_file`] does, without
/// reading it: the file and the metadata of the open descriptor, whose device and inode name
/// the file itself, whichever path (a link, another spelling) reached it.
pub fn open_regular_file(
    path: &Path,
    cap: u64,
    what: &str,
) -> Result<(std::fs::File, std::fs::Metadata), String> {
    use std::os::unix::fs::OpenOptionsExt;
    check_path_length(path)?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|err| {
            // A socket cannot be opened (ENXIO, "No such device or address"), which reads as
            // if it were missing: say what is there instead.
            match std::fs::metadata(path) {
                Ok(meta) if !meta.is_file() => format!(
                    "{}: not a regular file ({}); {}",
                    path.display(),
                    file_kind(&meta.file_type()),
                    allowed(what, cap)
                ),
                _ => format!("{}: cannot read {what}: {err}", path.display()),
            }
        })?;
    let meta = file
        .metadata()
        .map_err(|err| format!("{}: cannot read {what}: {err}", path.display()))?;
    let kind = meta.file_type();
    if !kind.is_file() {
        let is = file_kind(&kind);
        return Err(format!(
            "{}: not a regular file ({is}); {}",
            path.display(),
            allowed(what, cap)
        ));
    }
    if meta.len() > cap {
        return Err(format!(
            "{}: {} bytes, larger than the limit; {}",
            path.display(),
            meta.len(),
            allowed(what, cap)
        ));
    }
    Ok((file, meta))
}

/// Reads the text of a file [`open_regular_file`] opened (`meta` is what it returned), at
/// most `cap` bytes: a file that grew past it since it was opened is refused.
pub fn read_opened_file(
    file: std::fs::File,
    meta: &std::fs::Metadata,
    path: &Path,
    cap: u64,
    what: &str,
) -> Result<String, String> {
    use std::io::Read;
    let mut bytes = Vec::with_capacity(meta.len().min(cap) as usize);
    // One byte more than the cap tells a file that grew since the check.
    file.take(cap + 1)
        .read_to_end(&mut bytes)
        .map_err(|err| format!("{}: cannot read {what}: {err}", path.display()))?;
    if bytes.len() as u64 > cap {
        return Err(format!(
            "{}: grew past the limit while read; {}",
            path.display(),
            allowed(what, cap)
        ));
    }
    String::from_utf8(bytes).map_err(|err| {
        // Where: one stray byte (a Latin-1 letter in a comment) is found by its line.
        let good = &err.as_bytes()[..err.utf8_error().valid_up_to()];
        let line = good.iter().filter(|&&b| b == b'\n').count() + 1;
        let column = good.len() - good.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1) + 1;
        format!(
            "{}:{line}: cannot read {what}: not UTF-8 text (byte {column} of the line, byte {} \
             of the file); save it as UTF-8",
            path.display(),
            good.len() + 1
        )
    })
}

/// Why `path` is not a regular file, for errors: "does not exist", "is not a regular file
/// (a FIFO)", or the error that stat gave (a symbolic link loop, no permission, ...).
pub fn why_not_a_file(path: &Path) -> String {
    match std::fs::metadata(path) {
        Ok(meta) => format!("is not a regular file ({})", file_kind(&meta.file_type())),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => "does not exist".into(),
        Err(err) => format!("cannot be read: {err}"),
    }
}

/// What a file that is not a regular one is, for errors: "a directory", "a FIFO", ...
pub fn file_kind(kind: &std::fs::FileType) -> &'static str {
    use std::fs::FileType;
    use std::os::unix::fs::FileTypeExt;
    type Test = fn(&FileType) -> bool;
    let kinds: [(Test, &str); 7] = [
        (FileType::is_file, "a regular file"),
        (FileType::is_dir, "a directory"),
        (FileTypeExt::is_fifo, "a FIFO"),
        (FileTypeExt::is_char_device, "a character device"),
        (FileTypeExt::is_block_device, "a block device"),
        (FileTypeExt::is_socket, "a socket"),
        (FileType::is_symlink, "a symbolic link"),
    ];
    kinds
        .iter()
        .find(|(is, _)| is(kind))
        .map_or("special", |&(_, name)| name)
}

/// "64 MiB" for whole MiB, bytes otherwise.
fn human_bytes(n: u64) -> String {
    if n >= 1 << 20 && n % (1 << 20) == 0 {
        format!("{} MiB", n >> 20)
    } else {
        format!("{n} bytes")
    }
}
