// SPDX-License-Identifier: MPL-2.0
//! One stream's frames from arrival to departure: which are inferred (`interval`), which
//! still wait for their scores (one score vector per item: the whole frame and/or each of its
//! regions), when the oldest has waited `batch-timeout`, which a live source's deadline gave
//! up on, and which may leave, in arrival order. No GStreamer element in here: the element
//! admits frames, hands in the scores its engine returns, and sends on what `release` gives
//! back.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Why a frame leaves without scores of its own, carrying the last result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unscored {
    /// Not its turn (`interval`).
    Carried,
    /// The engine could not classify it by its deadline (a live source, overloaded).
    Late,
    /// Downstream said it was late already (QoS).
    Qos,
    /// The engine's server did not answer for it (`backend=kserve`).
    Unanswered,
}

/// A frame held until its scores arrive and every frame before it has left.
struct Held<F> {
    frame: F,
    number: u64,
    /// `None`: inferred; otherwise why it carries the last result.
    unscored: Option<Unscored>,
    /// A fresh frame's scores, one vector per item, as its items' batches run.
    scores: Vec<Vec<f32>>,
    /// How many of its items still wait for their scores.
    waiting: usize,
    arrived: Instant,
    /// When it was due (a live source): how late it leaves is measured from there.
    due: Option<Instant>,
    /// When it leaves, scored or not (a live source's deadline); `None`: when scored.
    leave_by: Option<Instant>,
}

/// A frame that may leave: its number in the stream, its items' scores if it was inferred
/// (`None`: it carries the previous result, for the reason in `unscored`), and when it
/// arrived.
pub(crate) struct Released<F> {
    pub(crate) frame: F,
    pub(crate) number: u64,
    pub(crate) scores: Option<Vec<Vec<f32>>>,
    pub(crate) unscored: Option<Unscored>,
    pub(crate) arrived: Instant,
    pub(crate) due: Option<Instant>,
}

/// One stream's held frames, in arrival order (see the module's documentation).
pub(crate) struct Batcher<F> {
    held: VecDeque<Held<F>>,
    /// How many items of the fresh frames in `held` still wait for their scores.
    unscored: usize,
    /// The number the next frame gets.
    next_number: u64,
    /// Frames still to carry the last result before the next fresh one.
    carry_left: u32,
}

impl<F> Default for Batcher<F> {
    fn default() -> Self {
        Self {
            held: VecDeque::new(),
            unscored: 0,
            next_number: 0,
            carry_left: 0,
        }
    }
}

impl<F> Batcher<F> {
    /// Whether the next frame is to be inferred; the element pushes it into the engine
    /// before `admit`ting it.
    pub(crate) fn next_is_fresh(&self) -> bool {
        self.carry_left == 0
    }

    /// The number the next frame will get.
    pub(crate) fn next_number(&self) -> u64 {
        self.next_number
    }

    /// Holds the next frame, which came into the element at `arrived` (before it waited to
    /// be pushed into the engine), due at `due` (a live source); one in every `interval` is
    /// fresh (see `next_is_fresh`), and a fresh frame waits for the scores of its `items` (a
    /// fresh frame of none, such as one without regions to classify, leaves as soon as the
    /// frames before it), until `leave_by` at the latest (see `expire`).
    pub(crate) fn admit(
        &mut self,
        frame: F,
        interval: u32,
        (arrived, due): (Instant, Option<Instant>),
        items: usize,
        leave_by: Option<Instant>,
    ) {
        let fresh = self.next_is_fresh();
        let items = if fresh { items } else { 0 };
        self.carry_left = match fresh {
            true => interval.max(1) - 1,
            false => self.carry_left - 1,
        };
        self.push(Held {
            frame,
            number: self.next_number,
            unscored: (!fresh).then_some(Unscored::Carried),
            scores: Vec::with_capacity(items),
            waiting: items,
            arrived,
            due,
            leave_by,
        });
    }

    /// Holds the next frame, whose turn it was to be inferred, as one that carries the last
    /// result (`why`); the frame after it is inferred in its place.
    pub(crate) fn skip(
        &mut self,
        frame: F,
        (arrived, due): (Instant, Option<Instant>),
        why: Unscored,
    ) {
        self.push(Held {
            frame,
            number: self.next_number,
            unscored: Some(why),
            scores: Vec::new(),
            waiting: 0,
            arrived,
            due,
            leave_by: None,
        });
    }

    fn push(&mut self, held: Held<F>) {
        self.unscored += held.waiting;
        self.next_number += 1;
        self.held.push_back(held);
    }

    /// Gives up on the frames, oldest first, still waiting for scores at their `leave_by`
    /// (`now` or before): they leave in their turn carrying the last result (`Late`).
    /// Returns how many items they were still waiting for: the next scores of this stream,
    /// which the element must drop.
    pub(crate) fn expire(&mut self, now: Instant) -> usize {
        let mut abandoned = 0;
        for held in self.held.iter_mut().filter(|h| h.waiting > 0) {
            if held.leave_by.is_none_or(|t| t > now) {
                break;
            }
            abandoned += held.waiting;
            held.waiting = 0;
            held.scores.clear();
            held.unscored = Some(Unscored::Late);
        }
        self.unscored -= abandoned;
        abandoned
    }

    /// When the oldest frame still waiting for its scores is given up (see `expire`).
    pub(crate) fn next_expiry(&self) -> Option<Instant> {
        self.held.iter().find(|h| h.waiting > 0)?.leave_by
    }

    /// Gives the oldest item still waiting its scores; `Err` when none waits (the engine
    /// returned more score vectors than it was given items).
    pub(crate) fn score(&mut self, scores: Vec<f32>) -> Result<(), Vec<f32>> {
        match self.held.iter_mut().find(|h| h.waiting > 0) {
            Some(held) => {
                held.scores.push(scores);
                held.waiting -= 1;
                self.unscored -= 1;
                Ok(())
            }
            None => Err(scores),
        }
    }

    /// The oldest item still waiting gets no scores (the server did not answer for it): its
    /// frame leaves carrying the last result (`Unanswered`). `Err` when none waits.
    pub(crate) fn unanswered(&mut self) -> Result<(), ()> {
        let held = self.held.iter_mut().find(|h| h.waiting > 0).ok_or(())?;
        held.waiting -= 1;
        held.scores.clear();
        held.unscored = Some(Unscored::Unanswered);
        self.unscored -= 1;
        Ok(())
    }

    /// Takes, in order, every frame at the front that has its result: scored fresh frames and
    /// the carried frames after them.
    pub(crate) fn release(&mut self) -> Vec<Released<F>> {
        let mut out = Vec::new();
        while self.held.front().is_some_and(|h| h.waiting == 0) {
            let held = self.held.pop_front().expect("checked above");
            out.push(Released {
                frame: held.frame,
                number: held.number,
                scores: held.unscored.is_none().then_some(held.scores),
                unscored: held.unscored,
                arrived: held.arrived,
                due: held.due,
            });
        }
        out
    }

    /// How many items of fresh frames wait for their scores.
    pub(crate) fn unscored(&self) -> usize {
        self.unscored
    }

    /// How many frames are held.
    pub(crate) fn len(&self) -> usize {
        self.held.len()
    }

    /// The numbers of the first and last frames held, if any.
    pub(crate) fn held_range(&self) -> Option<(u64, u64)> {
        Some((self.held.front()?.number, self.held.back()?.number))
    }

    /// When the oldest frame still waiting for its scores will have waited `timeout`; `None`
    /// when no frame waits or there is no timeout.
    pub(crate) fn deadline(&self, timeout: Option<Duration>) -> Option<Instant> {
        let timeout = timeout?;
        self.held
            .iter()
            .find(|h| h.waiting > 0)
            .map(|h| h.arrived + timeout)
    }

    /// Drops every held frame (a flush); the next frame is fresh, since a result from before
    /// a seek describes another picture. Numbering goes on.
    pub(crate) fn flush(&mut self) {
        self.held.clear();
        self.unscored = 0;
        self.carry_left = 0;
    }

    /// A new stream: numbering starts again at 0, and the next frame is fresh.
    pub(crate) fn restart(&mut self) {
        self.next_number = 0;
        self.carry_left = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn numbers(released: &[Released<char>]) -> Vec<(u64, char, bool)> {
        released
            .iter()
            .map(|r| (r.number, r.frame, r.scores.is_some()))
            .collect()
    }

    #[test]
    fn frames_leave_in_order_once_scored_and_carried_frames_follow_theirs() {
        let mut b = Batcher::default();
        let fresh: Vec<bool> = "abcdefg"
            .chars()
            .map(|c| {
                let fresh = b.next_is_fresh();
                b.admit(c, 3, (Instant::now(), None), 1, None);
                fresh
            })
            .collect();
        assert_eq!(fresh, [true, false, false, true, false, false, true]);
        assert_eq!(b.unscored(), 3);
        // Nothing leaves before the first fresh frame has its scores.
        assert!(b.release().is_empty());
        b.score(vec![0.0]).unwrap();
        assert_eq!(
            numbers(&b.release()),
            [(0, 'a', true), (1, 'b', false), (2, 'c', false)]
        );
        b.score(vec![1.0]).unwrap();
        b.score(vec![2.0]).unwrap();
        assert_eq!(
            numbers(&b.release()),
            [
                (3, 'd', true),
                (4, 'e', false),
                (5, 'f', false),
                (6, 'g', true)
            ]
        );
        assert_eq!((b.unscored(), b.len()), (0, 0));
        assert_eq!(b.score(vec![9.0]), Err(vec![9.0]), "no frame waits");
    }

    #[test]
    fn a_frame_with_an_item_the_server_did_not_answer_leaves_unscored_in_its_turn() {
        let mut b = Batcher::default();
        b.admit('a', 1, (Instant::now(), None), 1, None);
        b.admit('b', 1, (Instant::now(), None), 2, None);
        b.admit('c', 1, (Instant::now(), None), 1, None);
        b.score(vec![1.0]).unwrap();
        b.score(vec![2.0]).unwrap();
        b.unanswered().unwrap();
        b.score(vec![3.0]).unwrap();
        let got: Vec<(char, bool, Option<Unscored>)> = b
            .release()
            .into_iter()
            .map(|r| (r.frame, r.scores.is_some(), r.unscored))
            .collect();
        assert_eq!(
            got,
            [
                ('a', true, None),
                ('b', false, Some(Unscored::Unanswered)),
                ('c', true, None)
            ]
        );
        assert_eq!(b.unanswered(), Err(()), "no frame waits");
    }

    #[test]
    fn scores_go_to_the_oldest_waiting_frame() {
        let mut b = Batcher::default();
        for c in "xyz".chars() {
            b.admit(c, 1, (Instant::now(), None), 1, None);
        }
        for s in [10.0, 11.0, 12.0] {
            b.score(vec![s]).unwrap();
        }
        let got: Vec<(char, f32)> = b
            .release()
            .into_iter()
            .map(|r| (r.frame, r.scores.unwrap()[0][0]))
            .collect();
        assert_eq!(got, [('x', 10.0), ('y', 11.0), ('z', 12.0)]);
    }

    #[test]
    fn a_frame_waits_for_every_item_and_one_of_none_leaves_in_its_turn() {
        let mut b = Batcher::default();
        b.admit('a', 1, (Instant::now(), None), 2, None);
        b.admit('b', 1, (Instant::now(), None), 0, None);
        b.admit('c', 1, (Instant::now(), None), 1, None);
        assert_eq!(b.unscored(), 3);
        assert!(
            b.release().is_empty(),
            "'b' has nothing to wait for, but 'a' has"
        );
        b.score(vec![1.0]).unwrap();
        assert!(b.release().is_empty(), "'a' has one item of two");
        b.score(vec![2.0]).unwrap();
        let got: Vec<(char, Vec<Vec<f32>>)> = b
            .release()
            .into_iter()
            .map(|r| (r.frame, r.scores.expect("fresh")))
            .collect();
        assert_eq!(got, [('a', vec![vec![1.0], vec![2.0]]), ('b', vec![])]);
        b.score(vec![3.0]).unwrap();
        assert_eq!(b.release()[0].scores, Some(vec![vec![3.0]]));
        assert_eq!(b.unscored(), 0);
    }

    #[test]
    fn the_deadline_is_the_oldest_unscored_frames() {
        let mut b = Batcher::default();
        assert_eq!(b.deadline(Some(Duration::from_millis(50))), None);
        let first = Instant::now();
        b.admit('a', 1, (first, None), 1, None);
        b.admit('b', 1, (first + Duration::from_millis(2), None), 1, None);
        let timeout = Some(Duration::from_millis(50));
        assert_eq!(b.deadline(timeout), Some(first + Duration::from_millis(50)));
        assert_eq!(b.deadline(None), None, "no timeout, no deadline");
        b.score(vec![0.0]).unwrap();
        // 'a' is scored: the deadline is 'b's now, even before 'a' leaves.
        assert_eq!(b.deadline(timeout), Some(first + Duration::from_millis(52)));
    }

    #[test]
    fn a_flush_drops_held_frames_and_numbering_goes_on_until_a_restart() {
        let mut b = Batcher::default();
        for c in "abcd".chars() {
            b.admit(c, 2, (Instant::now(), None), 1, None);
        }
        assert_eq!(b.held_range(), Some((0, 3)));
        b.flush();
        assert_eq!((b.len(), b.unscored(), b.held_range()), (0, 0, None));
        assert!(
            b.next_is_fresh(),
            "after a flush the next frame is inferred"
        );
        b.admit('e', 2, (Instant::now(), None), 1, None);
        assert_eq!(b.held_range(), Some((4, 4)));
        b.restart();
        assert_eq!(b.next_number(), 0);
        assert!(b.next_is_fresh());
    }

    #[test]
    fn frames_past_their_deadline_leave_unscored_in_their_turn_and_a_skip_keeps_the_turn() {
        let mut b = Batcher::default();
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        b.admit('a', 2, (t0, None), 2, Some(t0 + ms(100)));
        b.admit('b', 2, (t0, None), 1, None);
        b.skip('c', (t0, None), Unscored::Qos);
        assert!(b.next_is_fresh(), "a skipped frame keeps the turn");
        b.admit('d', 2, (t0, None), 1, Some(t0 + ms(300)));
        assert_eq!(b.unscored(), 3);
        b.score(vec![1.0]).unwrap();
        assert_eq!(b.next_expiry(), Some(t0 + ms(100)));
        assert_eq!(b.expire(t0 + ms(99)), 0, "not yet");
        // 'a' had one of its two items scored: one item is given up.
        assert_eq!(b.expire(t0 + ms(100)), 1);
        assert_eq!(b.next_expiry(), Some(t0 + ms(300)));
        let out = b.release();
        let got: Vec<_> = out.iter().map(|r| (r.frame, r.unscored)).collect();
        assert_eq!(
            got,
            [
                ('a', Some(Unscored::Late)),
                ('b', Some(Unscored::Carried)),
                ('c', Some(Unscored::Qos))
            ]
        );
        assert!(out.iter().all(|r| r.scores.is_none()));
        // The next scores are 'd's.
        b.score(vec![4.0]).unwrap();
        let d = b.release();
        assert_eq!(
            (d[0].frame, d[0].scores.clone()),
            ('d', Some(vec![vec![4.0]]))
        );
        assert_eq!((b.unscored(), b.len()), (0, 0));
    }
}
