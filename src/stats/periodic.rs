//! A background thread that rewrites the statistics file every `stats_interval`, so a run
//! that is killed still leaves numbers at most one interval old. The thread only exists
//! while the library has open comms: NCCL `dlclose`s the library after its last comm, and a
//! thread still running our code then would crash the process.

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A running periodic writer; stopping it (or dropping it) joins the thread.
pub struct PeriodicWriter {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl PeriodicWriter {
    /// Calls `write` every `interval` on a new thread until stopped.
    pub fn start(
        interval: Duration,
        write: impl Fn() + Send + 'static,
    ) -> std::io::Result<PeriodicWriter> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("lossy-stats".into())
            .stack_size(256 * 1024)
            .spawn(move || run(interval, &flag, write))?;
        Ok(PeriodicWriter {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops the thread and waits for it (at most one write in progress).
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let (lock, wake) = &*self.stop;
        if let Ok(mut stopped) = lock.lock() {
            *stopped = true;
        }
        wake.notify_all();
        if let Some(thread) = self.thread.take() {
            // A panic in the writer has nowhere to go; the thread is gone either way.
            let _ = thread.join();
        }
    }
}

impl Drop for PeriodicWriter {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn run(interval: Duration, stop: &(Mutex<bool>, Condvar), write: impl Fn()) {
    let (lock, wake) = stop;
    let Ok(mut stopped) = lock.lock() else {
        return;
    };
    let mut next = Instant::now() + interval;
    loop {
        // Stop may have been asked before this thread first took the lock.
        if *stopped {
            return;
        }
        // Condvar waits may wake early; wait out the rest of the interval.
        let now = Instant::now();
        if now < next {
            match wake.wait_timeout(stopped, next - now) {
                Ok((guard, _)) => stopped = guard,
                Err(_) => return,
            }
            continue;
        }
        drop(stopped);
        write();
        next += interval;
        if next < Instant::now() {
            next = Instant::now() + interval;
        }
        stopped = match lock.lock() {
            Ok(guard) => guard,
            Err(_) => return,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn writes_repeatedly_then_stops_promptly() {
        let count = Arc::new(AtomicU32::new(0));
        let seen = Arc::clone(&count);
        let writer = PeriodicWriter::start(Duration::from_millis(10), move || {
            seen.fetch_add(1, Ordering::Relaxed);
        })
        .expect("spawn");
        let deadline = Instant::now() + Duration::from_secs(10);
        while count.load(Ordering::Relaxed) < 3 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(count.load(Ordering::Relaxed) >= 3);
        writer.stop();
        let after = count.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(count.load(Ordering::Relaxed), after, "no write after stop");
    }

    #[test]
    fn stop_does_not_wait_for_a_long_interval() {
        let writer = PeriodicWriter::start(Duration::from_secs(3600), || {}).expect("spawn");
        let started = Instant::now();
        writer.stop();
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
