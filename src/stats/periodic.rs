//! A background thread that writes the statistics file: every `interval` (when the profile
//! sets `stats_interval`), so a run that is killed still leaves numbers at most one interval
//! old, and soon after each [`PeriodicWriter::request`] (at most one such write per
//! `min_gap`), so closing connections never write on the caller's thread. Stopping it writes
//! once more if a request is still open, then joins the thread.

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A running writer; stopping it (or dropping it) joins the thread.
pub struct PeriodicWriter {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

#[derive(Default)]
struct State {
    stopped: bool,
    requested: bool,
}

impl PeriodicWriter {
    /// Calls `write` on a new thread every `interval` (if any) and after requests, until
    /// stopped.
    pub fn start(
        interval: Option<Duration>,
        min_gap: Duration,
        write: impl Fn() + Send + 'static,
    ) -> std::io::Result<PeriodicWriter> {
        let shared = Arc::new(Shared::default());
        let theirs = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("lossy-stats".into())
            .stack_size(256 * 1024)
            .spawn(move || run(interval, min_gap, &theirs, write))?;
        Ok(PeriodicWriter {
            shared,
            thread: Some(thread),
        })
    }

    /// Asks for a write soon; returns at once.
    pub fn request(&self) {
        if let Ok(mut state) = self.shared.state.lock() {
            state.requested = true;
        }
        self.shared.wake.notify_all();
    }

    /// Stops the thread and waits for it: at most the write in progress, and one more if a
    /// request is still open.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Ok(mut state) = self.shared.state.lock() {
            state.stopped = true;
        }
        self.shared.wake.notify_all();
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

fn run(interval: Option<Duration>, min_gap: Duration, shared: &Shared, write: impl Fn()) {
    let Ok(mut state) = shared.state.lock() else {
        return;
    };
    let mut next_periodic = interval.map(|i| Instant::now() + i);
    let mut next_allowed = Instant::now();
    loop {
        if state.stopped {
            let last = state.requested;
            drop(state);
            if last {
                write();
            }
            return;
        }
        let now = Instant::now();
        let periodic_due = next_periodic.is_some_and(|at| now >= at);
        let request_due = state.requested && now >= next_allowed;
        if periodic_due || request_due {
            state.requested = false;
            drop(state);
            write();
            let done = Instant::now();
            next_allowed = done + min_gap;
            next_periodic = interval.map(|i| done + i);
            state = match shared.state.lock() {
                Ok(guard) => guard,
                Err(_) => return,
            };
            continue;
        }
        // Sleep until the next thing due; condvar waits may wake early, the loop checks.
        let deadline = match (next_periodic, state.requested) {
            (Some(at), true) => Some(at.min(next_allowed)),
            (Some(at), false) => Some(at),
            (None, true) => Some(next_allowed),
            (None, false) => None,
        };
        let woken = match deadline {
            Some(at) => shared
                .wake
                .wait_timeout(state, at.saturating_duration_since(now))
                .ok()
                .map(|(guard, _)| guard),
            None => shared.wake.wait(state).ok(),
        };
        state = match woken {
            Some(guard) => guard,
            None => return,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    const GAP: Duration = Duration::from_millis(20);

    fn counting() -> (Arc<AtomicU32>, impl Fn() + Send + 'static) {
        let count = Arc::new(AtomicU32::new(0));
        let seen = Arc::clone(&count);
        (count, move || {
            seen.fetch_add(1, Ordering::Relaxed);
        })
    }

    #[test]
    fn requests_are_written_off_the_caller_thread_and_coalesced() {
        let (count, write) = counting();
        let writer = PeriodicWriter::start(None, Duration::from_secs(3600), write).expect("spawn");
        writer.request();
        let deadline = Instant::now() + Duration::from_secs(10);
        while count.load(Ordering::Relaxed) < 1 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            count.load(Ordering::Relaxed),
            1,
            "the first request is written at once"
        );
        // A thousand more within the gap: none written until the writer stops, then one.
        for _ in 0..1000 {
            writer.request();
        }
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            count.load(Ordering::Relaxed),
            1,
            "requests within the gap wait"
        );
        writer.stop();
        assert_eq!(
            count.load(Ordering::Relaxed),
            2,
            "stop writes what was requested"
        );
    }

    #[test]
    fn stop_without_a_request_writes_nothing() {
        let (count, write) = counting();
        let writer = PeriodicWriter::start(None, GAP, write).expect("spawn");
        writer.stop();
        assert_eq!(count.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn writes_repeatedly_then_stops_promptly() {
        let count = Arc::new(AtomicU32::new(0));
        let seen = Arc::clone(&count);
        let writer = PeriodicWriter::start(Some(Duration::from_millis(10)), GAP, move || {
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
        let writer =
            PeriodicWriter::start(Some(Duration::from_secs(3600)), GAP, || {}).expect("spawn");
        let started = Instant::now();
        writer.stop();
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
