// SPDX-License-Identifier: MPL-2.0
//! Wakes the element when the oldest frame of a partial batch has waited `batch-timeout`, so a
//! stalled live source does not hold frames forever, and when another stream sharing the
//! engine has run a batch with this element's frames in it, so that they leave at once.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

#[derive(Default)]
struct Shared {
    deadline: Option<Instant>,
    /// Set by `wake`; apart from `deadline` so that re-arming never swallows a wake.
    woken: bool,
    shutdown: bool,
}

/// The element's timer thread; dropping it stops the thread.
pub(crate) struct BatchTimer {
    shared: Arc<(Mutex<Shared>, Condvar)>,
}

impl BatchTimer {
    /// Spawns the timer thread; `on_expire` runs on it each time an armed deadline passes or
    /// `wake` is called.
    pub(crate) fn spawn(on_expire: impl Fn() + Send + 'static) -> std::io::Result<Self> {
        let shared = Arc::new((Mutex::new(Shared::default()), Condvar::new()));
        let thread_shared = shared.clone();
        std::thread::Builder::new()
            .name("trtclassify-timer".into())
            .spawn(move || {
                let (lock, cond) = &*thread_shared;
                let mut s = lock.lock().unwrap();
                loop {
                    if s.shutdown {
                        return;
                    }
                    let expired = s.deadline.is_some_and(|d| Instant::now() >= d);
                    if expired || s.woken {
                        if expired {
                            s.deadline = None;
                        }
                        s.woken = false;
                        drop(s);
                        on_expire();
                        s = lock.lock().unwrap();
                        continue;
                    }
                    s = match s.deadline {
                        None => cond.wait(s).unwrap(),
                        Some(d) => cond.wait_timeout(s, d - Instant::now()).unwrap().0,
                    };
                }
            })?;
        Ok(Self { shared })
    }

    /// Runs `on_expire` at `deadline` (replacing the deadline set before).
    pub(crate) fn arm(&self, deadline: Instant) {
        let (lock, cond) = &*self.shared;
        lock.lock().unwrap().deadline = Some(deadline);
        cond.notify_one();
    }

    /// Wakes the thread now; never blocks for longer than the thread's own bookkeeping.
    pub(crate) fn wake(&self) {
        let (lock, cond) = &*self.shared;
        lock.lock().unwrap().woken = true;
        cond.notify_one();
    }

    /// Cancels the deadline; a wake already asked for still runs.
    pub(crate) fn disarm(&self) {
        self.shared.0.lock().unwrap().deadline = None;
    }
}

impl Drop for BatchTimer {
    /// Stops the thread without joining it: it may be waiting for the pad's stream lock, which
    /// the caller (the element's `stop()`) can hold; it exits as soon as it gets it.
    fn drop(&mut self) {
        let (lock, cond) = &*self.shared;
        lock.lock().unwrap().shutdown = true;
        cond.notify_one();
    }
}
