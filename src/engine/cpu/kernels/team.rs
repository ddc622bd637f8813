// SPDX-License-Identifier: MPL-2.0
//! Threads that stay awake through one run of a plan: a frame spread over several cores is a
//! hundred steps of tens of microseconds each, and waking a sleeping pool thread for each
//! (rayon's threads sleep when idle; a virtual machine's idle core may be halted) took about
//! as long as the step. Between steps the team's threads spin, as onnxruntime's do, and
//! sleep again when the run ends.
//!
//! One run holds the team at a time; a run that finds it taken spreads its steps over the
//! shared pool instead, so that many elements do not spin against each other.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::thread::Thread;

/// One step's work: items `0..n`, each thread of the run a contiguous share of them, the
/// same share from step to step (the caller's the first), so that a thread reads the rows
/// that it wrote the step before, still in its own core's cache.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    n: usize,
    /// The helpers that take part (the run's threads less the caller's).
    helpers: usize,
}

#[derive(Default)]
struct Shared {
    /// Counts the jobs handed out; a helper that sees it change takes part in the new job.
    epoch: AtomicUsize,
    job: AtomicPtr<Job<'static>>,
    /// Helpers done with the current job: the caller waits for all of them, so that none
    /// still reads a job that is gone.
    checked_in: AtomicUsize,
    /// Whether a run holds the team (its helpers spin) or not (they sleep).
    running: AtomicBool,
}

pub struct Team {
    shared: Arc<Shared>,
    helpers: Vec<Thread>,
    /// Held by the run that uses the team.
    held: Mutex<()>,
}

thread_local! {
    /// The team of the run on this thread, while it runs.
    static CURRENT: Cell<Option<&'static Team>> = const { Cell::new(None) };
}

/// The team: as many helpers as the machine has cores, less the calling thread's.
static TEAM: LazyLock<Team> = LazyLock::new(|| Team::new(super::super::cores() - 1));

impl Team {
    fn new(helpers: usize) -> Team {
        let shared = Arc::new(Shared::default());
        let helpers = (0..helpers)
            .map(|index| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("trtclassify-team-{index}"))
                    .spawn(move || help(&shared, index))
                    .expect("a thread")
                    .thread()
                    .clone()
            })
            .collect();
        Team {
            shared,
            helpers,
            held: Mutex::new(()),
        }
    }

    /// Runs `f` with the team awake for the `threads.for_each` calls it makes on this thread,
    /// or, where another run holds the team, as it is.
    pub fn run<R>(f: impl FnOnce() -> R) -> R {
        let team: &'static Team = &TEAM;
        let Ok(_held) = team.held.try_lock() else {
            return f();
        };
        team.shared.running.store(true, Ordering::SeqCst);
        team.helpers.iter().for_each(Thread::unpark);
        let previous = CURRENT.replace(Some(team));
        // Put back on the way out, a panic included.
        struct Done(&'static Team, Option<&'static Team>);
        impl Drop for Done {
            fn drop(&mut self) {
                CURRENT.set(self.1);
                self.0.shared.running.store(false, Ordering::SeqCst);
            }
        }
        let _done = Done(team, previous);
        f()
    }

    /// Runs `f` on each of `0..n` with `threads - 1` helpers, if a team runs on this thread;
    /// `None` (and nothing run) otherwise.
    pub fn for_each(n: usize, threads: usize, f: &(dyn Fn(usize) + Sync)) -> Option<()> {
        let team = CURRENT.get()?;
        let shared = &team.shared;
        let job = Job {
            f,
            n,
            helpers: threads.saturating_sub(1).min(team.helpers.len()),
        };
        shared.checked_in.store(0, Ordering::SeqCst);
        // SAFETY (of the lifetime's extension): the job outlives its use; every helper
        // checks in, done with it, before this returns.
        let ptr = &job as *const Job as *mut Job<'static>;
        shared.job.store(ptr, Ordering::SeqCst);
        shared.epoch.fetch_add(1, Ordering::SeqCst);
        // Waits for the helpers on the way out, a panic included, since they read `job`.
        struct CheckIn(&'static Team);
        impl Drop for CheckIn {
            fn drop(&mut self) {
                let shared = &self.0.shared;
                let mut spins = 0u32;
                while shared.checked_in.load(Ordering::SeqCst) < self.0.helpers.len() {
                    wait(&mut spins);
                }
                shared.job.store(std::ptr::null_mut(), Ordering::SeqCst);
                CURRENT.set(Some(self.0));
            }
        }
        let _check_in = CheckIn(team);
        // A job's items run no jobs of their own through the team.
        CURRENT.set(None);
        take_items(&job, 0);
        Some(())
    }
}

/// The share of thread `part` of the run (0 the caller, 1 + index for a helper).
fn take_items(job: &Job, part: usize) {
    let parts = job.helpers + 1;
    (part * job.n / parts..(part + 1) * job.n / parts).for_each(job.f);
}

/// A spin, or after a while a yield of the core: a descheduled helper is waited for
/// without taking the core it needs.
fn wait(spins: &mut u32) {
    *spins += 1;
    if *spins < 1 << 14 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

/// A helper: takes part in each job while a run holds the team, sleeps otherwise.
fn help(shared: &Shared, index: usize) {
    // The team's first epoch: a helper that starts late still takes part in every job.
    let mut seen = 0;
    let mut spins = 0u32;
    loop {
        let epoch = shared.epoch.load(Ordering::SeqCst);
        if epoch == seen {
            if shared.running.load(Ordering::SeqCst) {
                wait(&mut spins);
            } else {
                spins = 0;
                std::thread::park();
            }
            continue;
        }
        spins = 0;
        seen = epoch;
        // SAFETY: the caller published the job before the epoch, and keeps it until
        // this helper checks in below.
        let job = unsafe { &*shared.job.load(Ordering::SeqCst) };
        if index < job.helpers {
            // A panic in an item is the caller's to see (the item is not done); the helper
            // checks in all the same, and lives on.
            let items = std::panic::AssertUnwindSafe(|| take_items(job, index + 1));
            let _ = std::panic::catch_unwind(items);
        }
        shared.checked_in.fetch_add(1, Ordering::SeqCst);
    }
}
