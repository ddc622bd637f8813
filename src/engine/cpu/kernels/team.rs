// SPDX-License-Identifier: MPL-2.0
//! Threads that stay awake through one run of a plan: a frame spread over several cores is a
//! hundred steps of tens of microseconds each, and waking a sleeping pool thread for each
//! (rayon's threads sleep when idle; a virtual machine's idle core may be halted) took about
//! as long as the step. Between steps the team's threads spin, as onnxruntime's do, and
//! sleep again when the run ends.
//!
//! One run holds the team at a time; a run that finds it taken spreads its steps over the
//! shared pool instead (`Team::run` gives it back), so that many elements do not spin
//! against each other.

use std::cell::Cell;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
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

struct Shared {
    /// The run that holds the team and the helpers that take part in it (the first ones;
    /// the others sleep, so that a run of two threads keeps two cores busy, not all of
    /// them), one word (`run << 8 | helpers`) so that a helper reads both at once.
    state: AtomicUsize,
    /// The run each helper last joined: it records there the run whose jobs it takes part
    /// in, once it knows the epoch they start after.
    joined: Box<[AtomicUsize]>,
    /// Counts the jobs handed out; a helper that sees it change takes part in the new job.
    epoch: AtomicUsize,
    job: AtomicPtr<Job<'static>>,
    /// Helpers done with the current job: the caller waits for all of them, so that none
    /// still reads a job that is gone.
    checked_in: AtomicUsize,
    /// A helper's panic in its share of a job, for the caller to raise again.
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
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

/// The team: as many helpers as the machine has cores, less the calling thread's (up to
/// 255, what `Shared::state` holds).
static TEAM: LazyLock<Team> = LazyLock::new(|| Team::new((super::super::cores() - 1).min(255)));

/// A run and its helpers, from `Shared::state`.
fn unpack(state: usize) -> (usize, usize) {
    (state >> 8, state & 0xFF)
}

impl Team {
    fn new(helpers: usize) -> Team {
        let shared = Arc::new(Shared {
            state: AtomicUsize::new(0),
            joined: (0..helpers).map(|_| AtomicUsize::new(0)).collect(),
            epoch: AtomicUsize::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            checked_in: AtomicUsize::new(0),
            panic: Mutex::new(None),
        });
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

    /// Runs `f` on this thread with `threads - 1` of the team's helpers awake for the
    /// `threads.for_each` calls it makes; gives `f` back, not run, where another run holds
    /// the team.
    pub fn run<R, F: FnOnce() -> R>(threads: usize, f: F) -> Result<R, F> {
        let team: &'static Team = &TEAM;
        let Ok(_held) = team.held.try_lock() else {
            return Err(f);
        };
        let shared = &team.shared;
        let awake = threads.saturating_sub(1).min(team.helpers.len());
        let run = unpack(shared.state.load(Ordering::SeqCst)).0 + 1;
        shared.state.store(run << 8 | awake, Ordering::SeqCst);
        team.helpers[..awake].iter().for_each(Thread::unpark);
        // No job before every helper of the run knows the epoch it starts after.
        let mut spins = 0u32;
        for joined in &shared.joined[..awake] {
            while joined.load(Ordering::SeqCst) != run {
                wait(&mut spins);
            }
        }
        let previous = CURRENT.replace(Some(team));
        // Put back on the way out, a panic included.
        struct Done(&'static Team, Option<&'static Team>);
        impl Drop for Done {
            fn drop(&mut self) {
                CURRENT.set(self.1);
                let shared = &self.0.shared;
                let run = unpack(shared.state.load(Ordering::SeqCst)).0;
                shared.state.store(run << 8, Ordering::SeqCst);
            }
        }
        let _done = Done(team, previous);
        Ok(f())
    }

    /// Whether a run holds the team on this thread.
    pub fn active() -> bool {
        CURRENT.get().is_some()
    }

    /// Runs `f` on each of `0..n` with the run's helpers, if a team runs on this thread;
    /// `None` (and nothing run) otherwise.
    pub fn for_each(n: usize, f: &(dyn Fn(usize) + Sync)) -> Option<()> {
        let team = CURRENT.get()?;
        let shared = &team.shared;
        let job = Job {
            f,
            n,
            helpers: unpack(shared.state.load(Ordering::SeqCst)).1,
        };
        shared.checked_in.store(0, Ordering::SeqCst);
        // A panic left by a job whose caller panicked too is not this job's.
        shared
            .panic
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        // SAFETY (of the lifetime's extension): the job outlives its use; every helper of
        // the run checks in, done with it, before this returns.
        let ptr = &job as *const Job as *mut Job<'static>;
        shared.job.store(ptr, Ordering::SeqCst);
        shared.epoch.fetch_add(1, Ordering::SeqCst);
        // Waits for the helpers on the way out, a panic included, since they read `job`.
        struct CheckIn<'a>(&'static Team, &'a Job<'a>);
        impl Drop for CheckIn<'_> {
            fn drop(&mut self) {
                let shared = &self.0.shared;
                let mut spins = 0u32;
                while shared.checked_in.load(Ordering::SeqCst) < self.1.helpers {
                    wait(&mut spins);
                }
                shared.job.store(std::ptr::null_mut(), Ordering::SeqCst);
                CURRENT.set(Some(self.0));
            }
        }
        let check_in = CheckIn(team, &job);
        // A job's items run no jobs of their own through the team.
        CURRENT.set(None);
        take_items(&job, 0);
        drop(check_in);
        let panic = shared
            .panic
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(panic) = panic {
            std::panic::resume_unwind(panic);
        }
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

/// A helper: takes part in each job of a run that wakes it, sleeps otherwise.
fn help(shared: &Shared, index: usize) {
    let (mut mine, mut seen, mut spins) = (0, 0, 0u32);
    // Whether the run that holds the team is `mine`, and this helper part of it.
    let in_run = |mine: usize| {
        let (run, helpers) = unpack(shared.state.load(Ordering::SeqCst));
        (run == mine && index < helpers, run, helpers)
    };
    loop {
        let (_, run, helpers) = in_run(mine);
        if index >= helpers {
            spins = 0;
            std::thread::park();
            continue;
        }
        if run != mine {
            // A new run: its jobs are those after the epoch now (the caller waits for this
            // before handing out the first).
            mine = run;
            seen = shared.epoch.load(Ordering::SeqCst);
            shared.joined[index].store(run, Ordering::SeqCst);
            continue;
        }
        let epoch = shared.epoch.load(Ordering::SeqCst);
        if epoch == seen {
            wait(&mut spins);
            continue;
        }
        // A new job, of this helper's run if the run still is (a run publishes its state
        // before its jobs): else the state is read again from the top.
        if !in_run(mine).0 {
            continue;
        }
        spins = 0;
        seen = epoch;
        // SAFETY: the caller published the job before the epoch, and keeps it until
        // this helper checks in below.
        let job = unsafe { &*shared.job.load(Ordering::SeqCst) };
        let items = std::panic::AssertUnwindSafe(|| take_items(job, index + 1));
        if let Err(panic) = std::panic::catch_unwind(items) {
            *shared.panic.lock().unwrap_or_else(|e| e.into_inner()) = Some(panic);
        }
        shared.checked_in.fetch_add(1, Ordering::SeqCst);
    }
}
