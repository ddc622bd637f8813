// SPDX-License-Identifier: MPL-2.0
//! Threads that stay awake through one run of a plan: a frame spread over several cores is a
//! hundred steps of tens of microseconds each, and waking a sleeping pool thread for each
//! (rayon's threads sleep when idle; a virtual machine's idle core may be halted) took about
//! as long as the step. Between steps the team's threads spin, as onnxruntime's do, and
//! sleep again when the run ends.
//!
//! Nobody waits for a helper that has not begun: the run's caller starts without them, and
//! takes a step's share that no helper has taken once its own is done. A helper whose core
//! another process holds (a shared machine's, a Jetson's beside the GPU's work) delays no
//! step; onnxruntime's caller does the same. (A helper that has entered a step's job and is
//! then descheduled before it takes a share is still waited for: the caller cannot know it
//! will take none.) On the 2-core VM, with another process busy
//! on one core, MobileNetV2 at batch 1 on both took 8.9–10.3 ms a frame over five runs,
//! against 8.9–15.4 when each step waited for its helper; the element at 720p ran 83–88
//! frames/s against 76 (no wait for the helper's wake at each frame's start).
//!
//! One run holds the team at a time; a run that finds it taken spreads its steps over the
//! shared pool instead (`Team::run` gives it back), so that many elements do not spin
//! against each other.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::thread::Thread;

/// One step's work: items `0..n` in `parts` contiguous shares, one for each thread of the
/// run, the same share from step to step (the caller's the first), so that a thread reads
/// the rows that it wrote the step before, still in its own core's cache.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    n: usize,
    parts: usize,
}

struct Shared {
    /// The helpers that take part in the run that holds the team (the first ones; the others
    /// sleep, so that a run of two threads keeps two cores busy, not all of them); 0 between
    /// runs.
    awake: AtomicUsize,
    /// Counts the jobs handed out; a helper that sees it change tries the new job's door.
    epoch: AtomicUsize,
    job: AtomicPtr<Job<'static>>,
    /// Whether each share of the current job is taken.
    taken: Box<[AtomicBool]>,
    /// The current job's door: its epoch (the high 32 bits), whether the caller has closed
    /// it (`CLOSED`), and how many helpers are inside (`INSIDE`). A helper reads the job only
    /// from inside, and enters only while the door is open and of the epoch it saw. The
    /// caller, its shares done, closes the door and waits for those inside alone.
    door: AtomicU64,
    /// A helper's panic in its share of a job, for the caller to raise again.
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

const CLOSED: u64 = 1 << 31;
const INSIDE: u64 = CLOSED - 1;

/// The open, empty door of job `epoch`.
fn door(epoch: usize) -> u64 {
    (epoch as u64 & 0xFFFF_FFFF) << 32
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
        let shared = Arc::new(Shared {
            awake: AtomicUsize::new(0),
            epoch: AtomicUsize::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            taken: (0..=helpers).map(|_| AtomicBool::new(true)).collect(),
            door: AtomicU64::new(CLOSED),
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
        let awake = threads.saturating_sub(1).min(team.helpers.len());
        team.shared.awake.store(awake, Ordering::SeqCst);
        // The first steps may run before they are up: they join the job of the moment.
        team.helpers[..awake].iter().for_each(Thread::unpark);
        let previous = CURRENT.replace(Some(team));
        // Put back on the way out, a panic included.
        struct Done(&'static Team, Option<&'static Team>);
        impl Drop for Done {
            fn drop(&mut self) {
                CURRENT.set(self.1);
                self.0.shared.awake.store(0, Ordering::SeqCst);
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
            parts: shared.awake.load(Ordering::SeqCst) + 1,
        };
        // A panic left by a job whose caller panicked too is not this job's.
        shared
            .panic
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        // No helper is inside the last job's door (closed, emptied): the shares and the job
        // are the caller's to set before it opens the next.
        for taken in &shared.taken[..job.parts] {
            taken.store(false, Ordering::SeqCst);
        }
        // SAFETY (of the lifetime's extension): the job outlives its use; helpers read it
        // only inside its door, which the caller closes and waits empty before this returns.
        let ptr = &job as *const Job as *mut Job<'static>;
        shared.job.store(ptr, Ordering::SeqCst);
        let epoch = shared.epoch.load(Ordering::SeqCst).wrapping_add(1);
        shared.door.store(door(epoch), Ordering::SeqCst);
        shared.epoch.store(epoch, Ordering::SeqCst);
        // Closes the door and waits for the helpers inside on the way out, a panic included.
        struct Close(&'static Team);
        impl Drop for Close {
            fn drop(&mut self) {
                let shared = &self.0.shared;
                shared.door.fetch_or(CLOSED, Ordering::SeqCst);
                let mut spins = 0u32;
                while shared.door.load(Ordering::SeqCst) & INSIDE != 0 {
                    wait(&mut spins);
                }
                shared.job.store(std::ptr::null_mut(), Ordering::SeqCst);
                CURRENT.set(Some(self.0));
            }
        }
        let close = Close(team);
        // A job's items run no jobs of their own through the team.
        CURRENT.set(None);
        take_shares(shared, &job, 0);
        drop(close);
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

/// Runs the shares of `job` that no thread has taken: share `first` (the thread's own) and
/// then the others, in turn.
fn take_shares(shared: &Shared, job: &Job, first: usize) {
    for part in (first..job.parts).chain(0..first) {
        if !shared.taken[part].swap(true, Ordering::SeqCst) {
            (part * job.n / job.parts..(part + 1) * job.n / job.parts).for_each(job.f);
        }
    }
}

/// Enters the door of job `epoch` if it is open.
fn enter(shared: &Shared, epoch: usize) -> bool {
    let mut now = shared.door.load(Ordering::SeqCst);
    loop {
        if now & CLOSED != 0 || now >> 32 != door(epoch) >> 32 {
            return false;
        }
        match shared
            .door
            .compare_exchange_weak(now, now + 1, Ordering::SeqCst, Ordering::SeqCst)
        {
            Ok(_) => return true,
            Err(changed) => now = changed,
        }
    }
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
    let (mut seen, mut spins) = (0, 0u32);
    loop {
        if index >= shared.awake.load(Ordering::SeqCst) {
            spins = 0;
            std::thread::park();
            continue;
        }
        let epoch = shared.epoch.load(Ordering::SeqCst);
        if epoch == seen {
            wait(&mut spins);
            continue;
        }
        seen = epoch;
        // A job already done (the caller did every share) is not entered.
        if !enter(shared, epoch) {
            continue;
        }
        spins = 0;
        // SAFETY: inside the door, the job is the one the caller published before opening
        // it, kept until the door is empty again.
        let job = unsafe { &*shared.job.load(Ordering::SeqCst) };
        // A helper woken for a run of more helpers than the job's (a run that has ended)
        // takes no share.
        if index + 1 < job.parts {
            let shares = std::panic::AssertUnwindSafe(|| take_shares(shared, job, index + 1));
            if let Err(panic) = std::panic::catch_unwind(shares) {
                *shared.panic.lock().unwrap_or_else(|e| e.into_inner()) = Some(panic);
            }
        }
        shared.door.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_of_every_step_runs_once_before_the_step_returns() {
        // Three runners at once, each taking the team when it is free and running alone
        // when it is not, with steps of 1 to 97 items: after each step, every item has run
        // exactly once, none is left to a helper still at work, and none ran twice.
        let threads = super::super::super::cores().clamp(2, 4);
        std::thread::scope(|s| {
            for runner in 0..3 {
                s.spawn(move || {
                    let counts: Vec<AtomicUsize> = (0..97).map(|_| AtomicUsize::new(0)).collect();
                    for run in 0..200 {
                        let mut steps = || {
                            for step in 0..20 {
                                let n = 1 + (run * 7 + step * 13 + runner) % 97;
                                let f = |i: usize| {
                                    counts[i].fetch_add(1, Ordering::SeqCst);
                                };
                                if Team::for_each(n, &f).is_none() {
                                    (0..n).for_each(f);
                                }
                                for (i, count) in counts.iter().enumerate() {
                                    let count = count.swap(0, Ordering::SeqCst);
                                    let want = usize::from(i < n);
                                    assert_eq!(
                                        count, want,
                                        "run {run}, step {step}, item {i} of {n}"
                                    );
                                }
                            }
                        };
                        if let Err(alone) = Team::run(threads, &mut steps) {
                            alone();
                        }
                    }
                });
            }
        });
    }
}
