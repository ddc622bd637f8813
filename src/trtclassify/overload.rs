// SPDX-License-Identifier: MPL-2.0
//! The overload policy: when a frame of a live source gives up on the engine.
//!
//! A live source does not wait: a camera sends its frames at its own rate, and what the
//! element cannot take at once piles up upstream (in a jitterbuffer, a queue), with the delay
//! from capture to result growing without bound. So each frame of a live source gets a
//! deadline, from the time it is due (its running time on the pipeline clock plus the latency
//! upstream; its arrival, where there is no clock) and the allowed lateness (`max-lateness`;
//! by default `batch-timeout` plus the time of one batch): a frame the engine cannot take
//! (push) by its due time plus the lateness, less the time of a batch, leaves in its turn
//! without a result of its own, carrying the last one. A frame the engine took waits for its
//! result: its work is spent, and giving it up would waste the engine's time on overload,
//! when it is scarcest. It has it at the latest `batch-timeout` (its batch filling) and two
//! batches (one running, then its own) after it was taken; only past that (an engine that
//! does not return, a stuck GPU) is it given up too. A frame that arrives late already (its
//! stream fell behind), past the time it could still be pushed, gives up at once, so the
//! stream catches up instead of falling further behind (and does not take the engine from
//! the streams that are on time).
//!
//! Frames of sources that are not live keep back-pressure: each waits for its result.

use std::time::{Duration, Instant};

/// What the latency query upstream said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Upstream {
    pub(crate) live: bool,
    /// The upstream minimum latency: a live frame arrives that long after its running time.
    pub(crate) latency: gst::ClockTime,
}

/// When a frame of a live source gives up on the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Deadline {
    /// The engine must take the frame by then, leaving room for its batch to run.
    pub(crate) push_by: Instant,
    /// A frame taken leaves by then, with its result or (an engine that does not return)
    /// without.
    pub(crate) leave_by: Instant,
}

/// `max-lateness` in milliseconds: never give up (back-pressure, as for sources that are not
/// live).
pub(crate) const WAIT: i32 = -1;
/// `max-lateness` in milliseconds: `batch-timeout` plus the time of a batch.
pub(crate) const AUTOMATIC: i32 = 0;

/// The lateness a frame of a live source is allowed, from `max-lateness` (milliseconds, or
/// `WAIT` / `AUTOMATIC`), `batch-timeout` (`None`: frames wait for a full batch) and the time
/// of a batch; `None`: frames wait as long as it takes.
pub(crate) fn allowed_lateness(
    max_lateness_ms: i32,
    batch_timeout: Option<Duration>,
    batch_time: Duration,
) -> Option<Duration> {
    match max_lateness_ms {
        WAIT => None,
        AUTOMATIC => batch_timeout.map(|timeout| timeout + batch_time),
        ms => u64::try_from(ms).ok().map(Duration::from_millis),
    }
}

/// The deadline of a frame due at `due` (see the module's documentation) that is allowed
/// `lateness`, on an engine whose batches take `batch_time` and fill within `batch_timeout`
/// (`None`: no partial batches).
pub(crate) fn deadline(
    due: Instant,
    lateness: Duration,
    batch_time: Duration,
    batch_timeout: Option<Duration>,
) -> Deadline {
    let push_by = (due + lateness)
        .checked_sub(batch_time)
        .unwrap_or(due)
        .max(due);
    Deadline {
        push_by,
        leave_by: push_by + batch_timeout.unwrap_or_default() + 2 * batch_time,
    }
}

/// When a frame that arrived at `arrived` was due: when its running time says, where the
/// element has a clock and the buffer a time, else its arrival. A frame that came early is
/// due when it came, so that a deadline never makes upstream wait longer than the lateness.
pub(crate) fn due(arrived: Instant, by_clock: Option<Instant>) -> Instant {
    by_clock.map_or(arrived, |t| t.min(arrived))
}

/// The `Instant` of `clock_time` on a clock that reads `now_clock` at `now`.
pub(crate) fn instant_of(
    clock_time: gst::ClockTime,
    now_clock: gst::ClockTime,
    now: Instant,
) -> Instant {
    match clock_time.checked_sub(now_clock) {
        Some(ahead) => now + Duration::from_nanos(ahead.nseconds()),
        None => now
            .checked_sub(Duration::from_nanos((now_clock - clock_time).nseconds()))
            .unwrap_or(now),
    }
}

/// Downstream's quality-of-service reports: frames whose running time is before `earliest`
/// would be late at the sink already, so classifying them is wasted.
#[derive(Debug, Default)]
pub(crate) struct Qos {
    earliest: Option<gst::ClockTime>,
    pub(crate) proportion: f64,
    /// When the element last posted a QoS message, to post at most `QOS_MESSAGE_EVERY`.
    last_message: Option<Instant>,
}

/// The shortest time between two QoS messages of an element: an overloaded element passes on
/// hundreds of frames a second unclassified, and one message each would flood the bus. Once a
/// second, not more often: GStreamer's bus queue makes each poster spin until the posters
/// before it have finished, so with 64 cameras posting ten times a second each on a 2-core
/// machine, the cameras' threads spun in the bus for minutes (the counts the messages carry
/// add up, so fewer of them lose nothing).
pub(crate) const QOS_MESSAGE_EVERY: Duration = Duration::from_secs(1);

impl Qos {
    /// Takes a QoS event's figures, as GStreamer's base classes read them.
    pub(crate) fn update(&mut self, proportion: f64, diff: i64, timestamp: gst::ClockTime) {
        self.proportion = proportion;
        self.earliest = Some(match diff {
            d if d > 0 => timestamp.saturating_add(gst::ClockTime::from_nseconds(d as u64)),
            d => timestamp.saturating_sub(gst::ClockTime::from_nseconds(d.unsigned_abs())),
        });
    }

    /// Forgets the reports (a flush, a new segment: running times start again).
    pub(crate) fn reset(&mut self) {
        *self = Self::default();
    }

    /// Whether a frame at `running_time` would be late at the sink already.
    pub(crate) fn is_late(&self, running_time: Option<gst::ClockTime>) -> bool {
        matches!((self.earliest, running_time), (Some(e), Some(t)) if t <= e)
    }

    /// Whether a QoS message may be posted now (at most one per `QOS_MESSAGE_EVERY`).
    pub(crate) fn message_due(&mut self, now: Instant) -> bool {
        let due = self
            .last_message
            .is_none_or(|last| now.duration_since(last) >= QOS_MESSAGE_EVERY);
        if due {
            self.last_message = Some(now);
        }
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_automatic_lateness_is_the_batch_timeout_and_a_batch() {
        assert_eq!(
            allowed_lateness(AUTOMATIC, Some(100 * MS), 30 * MS),
            Some(130 * MS)
        );
        assert_eq!(allowed_lateness(AUTOMATIC, None, 30 * MS), None);
        assert_eq!(allowed_lateness(WAIT, Some(100 * MS), 30 * MS), None);
        assert_eq!(allowed_lateness(250, None, 30 * MS), Some(250 * MS));
    }

    #[test]
    fn a_frame_must_be_taken_a_batch_before_its_lateness_and_leaves_once_its_batch_ran() {
        let t0 = Instant::now();
        // Taken by 100 ms; then its batch fills (100 ms) and runs after the one running.
        let d = deadline(t0, 130 * MS, 30 * MS, Some(100 * MS));
        assert_eq!((d.push_by, d.leave_by), (t0 + 100 * MS, t0 + 260 * MS));
        // A batch longer than the lateness: the engine is tried once, at once.
        let d = deadline(t0, 10 * MS, 30 * MS, None);
        assert_eq!((d.push_by, d.leave_by), (t0, t0 + 60 * MS));
    }

    #[test]
    fn a_late_frame_is_due_when_its_clock_says_and_an_early_one_when_it_came() {
        let now = Instant::now();
        let clock = gst::ClockTime::from_seconds(10);
        let before = instant_of(gst::ClockTime::from_mseconds(9_900), clock, now);
        assert_eq!(before, now - 100 * MS);
        let after = instant_of(gst::ClockTime::from_mseconds(10_050), clock, now);
        assert_eq!(after, now + 50 * MS);
        assert_eq!(due(now, Some(before)), before);
        assert_eq!(due(now, Some(after)), now);
        assert_eq!(due(now, None), now);
    }

    #[test]
    fn qos_reports_mark_earlier_frames_late_and_messages_are_spaced() {
        let mut q = Qos::default();
        let s = gst::ClockTime::from_seconds;
        assert!(!q.is_late(Some(s(1))));
        q.update(1.5, 200_000_000, s(2));
        assert!(q.is_late(Some(gst::ClockTime::from_mseconds(2_200))));
        assert!(!q.is_late(Some(gst::ClockTime::from_mseconds(2_201))));
        assert!(!q.is_late(None), "a frame without a time is never late");
        q.update(0.5, -500_000_000, s(2));
        assert!(q.is_late(Some(gst::ClockTime::from_mseconds(1_500))));
        assert!(!q.is_late(Some(gst::ClockTime::from_mseconds(1_501))));
        q.reset();
        assert!(!q.is_late(Some(s(0))));
        let t0 = Instant::now();
        assert!(q.message_due(t0));
        assert!(!q.message_due(t0 + 999 * MS));
        assert!(q.message_due(t0 + QOS_MESSAGE_EVERY));
        assert!(!q.message_due(t0 + QOS_MESSAGE_EVERY + 999 * MS));
    }
}
