//! Temporary directories of the command's own: made fresh each time (never one that an
//! earlier run, killed before it cleaned up, left with its files in it), readable only by
//! their owner, and removed with everything in them when dropped, on error paths too.

use std::path::{Path, PathBuf};

use nccl_net_lossy::{Error, Result};

/// How many names a new directory tries before giving up (each taken one is skipped).
const ATTEMPTS: u32 = 1000;

/// A fresh temporary directory, removed when dropped.
#[derive(Debug)]
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    /// Makes `PREFIX-PID` in the temporary directory (`TMPDIR`), or `PREFIX-PID-N` when that
    /// name is taken.
    pub fn new(prefix: &str) -> Result<ScratchDir> {
        Self::new_in(&std::env::temp_dir(), prefix)
    }

    fn new_in(parent: &Path, prefix: &str) -> Result<ScratchDir> {
        use std::os::unix::fs::DirBuilderExt;
        let pid = std::process::id();
        for n in 0..ATTEMPTS {
            let name = match n {
                0 => format!("{prefix}-{pid}"),
                n => format!("{prefix}-{pid}-{n}"),
            };
            let dir = parent.join(name);
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => return Ok(ScratchDir(dir)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => {
                    return Err(Error::system(format!(
                        "cannot create a temporary directory {}: {e} (set TMPDIR to a writable \
                         directory)",
                        dir.display()
                    )))
                }
            }
        }
        Err(Error::system(format!(
            "cannot create a temporary directory {prefix}-{pid} in {}: {ATTEMPTS} names taken",
            parent.display()
        )))
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_left_by_an_earlier_run_is_skipped_and_the_directory_goes_with_its_files() {
        let parent =
            std::env::temp_dir().join(format!("lossy-scratch-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&parent);
        std::fs::create_dir_all(&parent).expect("parent");
        // A run killed before it cleaned up left its directory and a statistics file.
        let pid = std::process::id();
        let stale = parent.join(format!("lossy-demo-{pid}"));
        std::fs::create_dir(&stale).expect("stale directory");
        std::fs::write(stale.join("lossy-stats-rank0.json"), "{}").expect("stale file");
        let fresh = ScratchDir::new_in(&parent, "lossy-demo").expect("fresh directory");
        assert_eq!(fresh.path(), parent.join(format!("lossy-demo-{pid}-1")));
        assert_eq!(std::fs::read_dir(fresh.path()).expect("read").count(), 0);
        std::fs::write(fresh.path().join("file"), "x").expect("write");
        let path = fresh.path().to_path_buf();
        drop(fresh);
        assert!(!path.exists(), "{} still there", path.display());
        assert!(
            stale.join("lossy-stats-rank0.json").exists(),
            "not ours to remove"
        );
        let _ = std::fs::remove_dir_all(&parent);
    }

    #[test]
    fn a_parent_that_cannot_hold_it_is_named_with_advice() {
        let err = ScratchDir::new_in(Path::new("/proc/self/no-such-dir"), "lossy-demo")
            .expect_err("no such parent");
        let msg = err.to_string();
        assert!(msg.contains("/proc/self/no-such-dir/lossy-demo-"), "{msg}");
        assert!(msg.contains("TMPDIR"), "{msg}");
    }
}
