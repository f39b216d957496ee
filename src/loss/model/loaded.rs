//! The traces one profile loads: each file read once, whichever path names it (a symbolic or
//! hard link, `dir/../x`), and a limit on the memory the profile's traces keep together.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use crate::files::{open_regular_file, read_opened_file};
use crate::loss::model::binary_size;
use crate::loss::trace::{TraceData, TraceFormat, MAX_TRACE_BYTES};

/// Most bytes a profile's loaded traces keep together: 16 per lost run, each file's runs
/// counted once. The largest trace, a 16 MiB file ([`MAX_TRACE_BYTES`]), keeps at most
/// 128 MiB: a run takes at least two bytes of text (a bitmap alternating 1 and 0 is 8 Mi
/// runs). Twice that lets any trace load, and one beside it as large; a recording keeps far
/// less (a million packets at 1% loss: at most 10,000 runs, 160 KB), so a profile of a few
/// traces stays far under the limit. Without it a profile's 1024 rules, each naming a file of
/// its own, could keep 128 GiB in every process that loads the profile (every rank). While a
/// trace loads, its text and parse take at most about 200 MiB more, one trace at a time.
pub const MAX_LOADED_TRACE_BYTES: u64 = 256 << 20;

/// One file parsed in one format.
#[derive(Debug)]
struct Parsed {
    /// The file: device and inode of the descriptor it was read from.
    file: (u64, u64),
    /// The format it was parsed in.
    format: TraceFormat,
    /// Its runs, the trace as long as the text makes it.
    runs: TraceData,
    /// The traces handed out, by `length`; they share `runs`.
    traces: Vec<(Option<u64>, Arc<TraceData>)>,
}

/// The traces one profile has loaded, for [`super::ModelSpec::load_trace`] to share among the
/// rules that name the same file, and to keep within [`MAX_LOADED_TRACE_BYTES`].
#[derive(Debug)]
pub struct LoadedTraces {
    parsed: Vec<Parsed>,
    /// Bytes the runs in `parsed` keep.
    kept: u64,
    /// Most bytes they may keep.
    limit: u64,
}

impl Default for LoadedTraces {
    fn default() -> Self {
        LoadedTraces {
            parsed: Vec::new(),
            kept: 0,
            limit: MAX_LOADED_TRACE_BYTES,
        }
    }
}

impl LoadedTraces {
    /// A set that refuses traces keeping more than `limit` bytes together (tests).
    #[cfg(test)]
    pub(crate) fn with_limit(limit: u64) -> Self {
        LoadedTraces {
            limit,
            ..LoadedTraces::default()
        }
    }

    /// Bytes the loaded traces keep.
    pub fn kept_bytes(&self) -> u64 {
        self.kept
    }

    /// How many files were read and parsed (one per file and format).
    pub fn parsed_files(&self) -> usize {
        self.parsed.len()
    }

    /// The trace in the file at `path`, read and parsed unless this file (the same device and
    /// inode, whichever path reached it) was already, in this format; errors name `path`.
    pub fn load(
        &mut self,
        path: &Path,
        format: TraceFormat,
        length: Option<u64>,
    ) -> Result<Arc<TraceData>, String> {
        let name = path.display().to_string();
        // The identity is the open descriptor's, so the file read is the file named.
        let (file, meta) = open_regular_file(path, MAX_TRACE_BYTES, "trace")?;
        let id = (meta.dev(), meta.ino());
        let found = self
            .parsed
            .iter()
            .position(|p| p.file == id && p.format == format);
        let index = match found {
            Some(index) => index,
            None => {
                let runs = {
                    let text = read_opened_file(file, &meta, path, MAX_TRACE_BYTES, "trace")?;
                    TraceData::parse_runs(&text, format, &name)?
                };
                let kept = runs.kept_bytes();
                let total = self.kept.saturating_add(kept);
                if total > self.limit {
                    return Err(self.over_limit(&name, kept, total));
                }
                self.kept = total;
                self.parsed.push(Parsed {
                    file: id,
                    format,
                    runs,
                    traces: Vec::new(),
                });
                self.parsed.len() - 1
            }
        };
        let parsed = &mut self.parsed[index];
        if let Some((_, trace)) = parsed.traces.iter().find(|(l, _)| *l == length) {
            return Ok(Arc::clone(trace));
        }
        let trace = Arc::new(parsed.runs.with_length(format, length, &name)?);
        parsed.traces.push((length, Arc::clone(&trace)));
        Ok(trace)
    }

    /// The error for a trace of `kept` bytes that takes the total to `total`, over the limit.
    fn over_limit(&self, name: &str, kept: u64, total: u64) -> String {
        let before = match self.parsed.len() {
            0 => String::new(),
            1 => format!(", the trace loaded before it {}", binary_size(self.kept)),
            n => format!(", the {n} loaded before it {}", binary_size(self.kept)),
        };
        format!(
            "{name}: with this trace the profile's traces would keep {} in memory (this one \
             {}{before}; 16 bytes per lost run), over the limit of {} for all of a profile's \
             traces together: replay fewer traces or shorter ones (rules naming one file, by \
             any path, share one copy)",
            binary_size(total),
            binary_size(kept),
            binary_size(self.limit)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory under the temporary one, named for the test and this process.
    fn fresh_dir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("lossy-loaded-{name}-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        std::fs::create_dir_all(&dir).expect("create a test directory");
        dir
    }

    #[test]
    fn links_and_spellings_of_one_file_load_it_once_and_lengths_share_its_runs() {
        let dir = fresh_dir("once");
        std::fs::write(dir.join("drops.txt"), "3\n1\n2\n").expect("write");
        std::os::unix::fs::symlink(dir.join("drops.txt"), dir.join("sym.txt")).expect("link");
        std::fs::hard_link(dir.join("drops.txt"), dir.join("hard.txt")).expect("hard link");
        let mut loaded = LoadedTraces::default();
        let mut load = |file: &str, format, length| {
            loaded
                .load(&dir.join(file), format, length)
                .expect("a valid trace")
        };
        let first = load("drops.txt", TraceFormat::Indices, None);
        for file in ["sym.txt", "hard.txt", "./x/../drops.txt", "drops.txt"] {
            std::fs::create_dir_all(dir.join("x")).expect("mkdir");
            let again = load(file, TraceFormat::Indices, None);
            assert!(Arc::ptr_eq(&first, &again), "{file} loaded its own copy");
        }
        // Another length is another trace over the same runs, read once.
        let longer = load("sym.txt", TraceFormat::Indices, Some(100));
        assert_eq!((longer.length, first.length), (100, 4));
        assert!(Arc::ptr_eq(&first.runs, &longer.runs));
        assert!(Arc::ptr_eq(
            &longer,
            &load("hard.txt", TraceFormat::Indices, Some(100))
        ));
        assert_eq!(loaded.parsed_files(), 1);
        assert_eq!(loaded.kept_bytes(), 16);
        // Another format is another parse, counted as such.
        std::fs::write(dir.join("bits.txt"), "1\n0\n1\n").expect("write");
        let bits = loaded
            .load(&dir.join("bits.txt"), TraceFormat::Bitmap, None)
            .expect("a bitmap");
        let as_indices = loaded
            .load(&dir.join("bits.txt"), TraceFormat::Indices, None)
            .expect("indices");
        assert_eq!(*bits.runs, vec![(0, 1), (2, 1)]);
        assert_eq!(*as_indices.runs, vec![(0, 2)]);
        assert_eq!(
            (loaded.parsed_files(), loaded.kept_bytes()),
            (3, 16 + 32 + 16)
        );
        // Errors that depend on `length` name the path this rule gave.
        let err = loaded
            .load(&dir.join("sym.txt"), TraceFormat::Indices, Some(2))
            .unwrap_err();
        assert!(err.starts_with(&format!("{}: length = 2", dir.join("sym.txt").display())));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn traces_that_keep_more_than_the_limit_together_are_refused_naming_the_numbers() {
        let dir = fresh_dir("limit");
        // Each 20-packet bitmap alternating 1 and 0 keeps 10 runs: 160 bytes.
        for name in ["a", "b", "c"] {
            std::fs::write(dir.join(name), "10".repeat(10)).expect("write");
        }
        std::os::unix::fs::symlink(dir.join("a"), dir.join("link")).expect("link");
        let mut loaded = LoadedTraces::with_limit(400);
        for name in ["a", "link", "b", "link"] {
            loaded
                .load(&dir.join(name), TraceFormat::Bitmap, None)
                .expect("within the limit");
        }
        assert_eq!(loaded.kept_bytes(), 320);
        let err = loaded
            .load(&dir.join("c"), TraceFormat::Bitmap, None)
            .unwrap_err();
        let c = dir.join("c").display().to_string();
        assert_eq!(
            err,
            format!(
                "{c}: with this trace the profile's traces would keep 480 B in memory (this \
                 one 160 B, the 2 loaded before it 320 B; 16 bytes per lost run), over the \
                 limit of 400 B for all of a profile's traces together: replay fewer traces or \
                 shorter ones (rules naming one file, by any path, share one copy)"
            )
        );
        // The refused trace is not kept: what was loaded still loads.
        assert_eq!((loaded.kept_bytes(), loaded.parsed_files()), (320, 2));
        assert!(loaded
            .load(&dir.join("b"), TraceFormat::Bitmap, None)
            .is_ok());
        // The limit fits the largest trace a file may hold, with room for one more.
        let largest = TraceData::parse_runs(
            &"10".repeat(MAX_TRACE_BYTES as usize / 2),
            TraceFormat::Bitmap,
            "t",
        )
        .expect("parse");
        assert_eq!(largest.kept_bytes(), 128 << 20);
        assert_eq!(2 * largest.kept_bytes(), MAX_LOADED_TRACE_BYTES);
        std::fs::remove_dir_all(&dir).ok();
    }
}
