// SPDX-License-Identifier: MPL-2.0
//! How far a quantized engine's answers are from the unquantized one's on the same frames:
//! the build's accuracy guard.

/// The top-1 agreement, the largest probability error and the largest logit error of
/// quantized scores against reference scores for the same frames.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Agreement {
    /// Frames compared.
    pub frames: usize,
    /// Frames whose top class is the same.
    pub same_top1: usize,
    /// The largest difference of any class's probability (softmax of the scores, or the
    /// scores themselves where they are probabilities already).
    pub max_probability_error: f32,
    /// The largest logit error of a frame: the root-mean-square difference of the centred
    /// log-probabilities over that of the reference's. The centred log-probabilities are the
    /// logits less their mean, wherever no probability underflows, so this measures how far
    /// the logits moved against their own spread. A probability moves with its own logit as
    /// p(1 − p), so that random weights, which leave classes near ties, turn the same
    /// logit error into probability errors that vary from frame to frame. A NaN, or any
    /// move from a reference of equal scores, counts as infinite.
    pub max_logit_error: f32,
}

impl Agreement {
    /// Compares `quantized` with `reference`, each `classes` scores a frame, frame by frame;
    /// adds to what was compared before.
    pub fn add(&mut self, reference: &[f32], quantized: &[f32], classes: usize) {
        assert_eq!(reference.len(), quantized.len());
        for (r, q) in reference
            .chunks_exact(classes)
            .zip(quantized.chunks_exact(classes))
        {
            self.frames += 1;
            self.same_top1 += usize::from(top1(r) == top1(q));
            // Both sides as the reference is: an engine's probabilities that sum to 1 a
            // little less closely are not to be read as logits.
            let (r, q) = match is_distribution(r) {
                true => (r.to_vec(), q.to_vec()),
                false => (softmax(r), softmax(q)),
            };
            // A NaN counts as the largest error.
            let error = (r.iter().zip(&q))
                .map(|(a, b)| (a - b).abs())
                .map(|d| if d.is_nan() { f32::INFINITY } else { d })
                .fold(0.0f32, f32::max);
            self.max_probability_error = self.max_probability_error.max(error);
            self.max_logit_error = self.max_logit_error.max(logit_error(&r, &q));
        }
    }

    /// The share of frames whose top class is the same, 0 to 1 (1 with no frames).
    pub fn top1(&self) -> f64 {
        match self.frames {
            0 => 1.0,
            n => self.same_top1 as f64 / n as f64,
        }
    }
}

impl std::fmt::Display for Agreement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "top-1 agreement {:.2} % ({} of {} frames), largest probability error {:.4}",
            self.top1() * 100.0,
            self.same_top1,
            self.frames,
            self.max_probability_error
        )
    }
}

/// The index of the largest score; NaN loses to any number.
fn top1(scores: &[f32]) -> usize {
    let value = |i: usize| match scores[i].is_nan() {
        true => f32::NEG_INFINITY,
        false => scores[i],
    };
    (0..scores.len())
        .max_by(|&a, &b| value(a).total_cmp(&value(b)))
        .unwrap_or(0)
}

/// `quantized`'s centred log-probabilities' root-mean-square difference from `reference`'s,
/// over that of `reference`'s; a NaN, or any difference from a reference of equal
/// probabilities, counts as infinite.
fn logit_error(reference: &[f32], quantized: &[f32]) -> f32 {
    let centred = |p: &[f32]| {
        // `max` would take a NaN for the bound: it must stay NaN.
        let logs: Vec<f64> = (p.iter())
            .map(|&v| match v.is_nan() {
                true => f64::NAN,
                false => f64::from(v.max(f32::MIN_POSITIVE)).ln(),
            })
            .collect();
        let mean = logs.iter().sum::<f64>() / logs.len() as f64;
        logs.into_iter().map(move |v| v - mean)
    };
    let (diff, norm) = centred(quantized)
        .zip(centred(reference))
        .fold((0.0, 0.0), |(d, n), (q, r)| {
            (d + (q - r) * (q - r), n + r * r)
        });
    // Equal scores centre to what the mean's rounding leaves, about 1e-15 each.
    let tie = norm <= 1e-24 * reference.len() as f64;
    match (diff / norm).sqrt() as f32 {
        e if e.is_nan() || tie => match diff <= 1e-24 * reference.len() as f64 {
            true => 0.0,
            false => f32::INFINITY,
        },
        e => e,
    }
}

/// Whether `scores` are probabilities already: between 0 and 1, summing to 1.
fn is_distribution(scores: &[f32]) -> bool {
    let sum: f32 = scores.iter().sum();
    scores.iter().all(|s| (0.0..=1.0).contains(s)) && (sum - 1.0).abs() < 1e-3
}

fn softmax(scores: &[f32]) -> Vec<f32> {
    let top = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = scores.iter().map(|s| (s - top).exp()).collect();
    let total: f32 = exp.iter().sum();
    exp.iter().map(|e| e / total).collect()
}
