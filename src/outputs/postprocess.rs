// SPDX-License-Identifier: MPL-2.0
//! From a model's score vector to the reported classes: softmax when needed, then top-k.

/// Whether scores are turned into probabilities with a softmax.
#[derive(Debug, Eq, PartialEq, Ord, PartialOrd, Hash, Clone, Copy, Default, glib::Enum)]
#[repr(u32)]
#[enum_type(name = "GstTrtClassifySoftmax")]
pub enum Softmax {
    /// Applied unless the model ends in Softmax/Sigmoid or its first scores already are
    /// probabilities.
    #[default]
    #[enum_value(
        name = "Auto: apply it unless the model ends in Softmax/Sigmoid or its scores already are probabilities",
        nick = "auto"
    )]
    Auto = 0,
    /// Always applied.
    #[enum_value(name = "On: always apply it", nick = "on")]
    On = 1,
    /// Never applied: the scores are reported as they are.
    #[enum_value(name = "Off: report the scores as they are", nick = "off")]
    Off = 2,
}

/// True when every score lies in [0, 1] and they add up to 1: the scores already are a
/// probability distribution and a softmax would flatten it.
pub fn is_distribution(scores: &[f32]) -> bool {
    let sum: f32 = scores.iter().sum();
    scores.iter().all(|s| (0.0..=1.0).contains(s)) && (sum - 1.0).abs() < 1e-3
}

/// Turns `scores` into probabilities (numerically stable: the maximum is subtracted first);
/// scores whose maximum is not finite are left as they are.
pub fn softmax_in_place(scores: &mut [f32]) {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return;
    }
    let mut sum = 0.0;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    for s in scores.iter_mut() {
        *s /= sum;
    }
}

/// The `k` best classes with a score of at least `threshold`, best first. Ties keep the lower
/// class id first; NaN scores are never reported.
pub fn top_k(scores: &[f32], k: usize, threshold: f32) -> Vec<(usize, f32)> {
    let mut best: Vec<(usize, f32)> = scores
        .iter()
        .copied()
        .enumerate()
        .filter(|(_, s)| *s >= threshold)
        .collect();
    let by_score = |a: &(usize, f32), b: &(usize, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if best.len() > k {
        best.select_nth_unstable_by(k, by_score);
        best.truncate(k);
    }
    best.sort_by(by_score);
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_is_sorted_and_thresholded() {
        let scores = [0.1, 0.5, 0.05, 0.3, 0.05];
        assert_eq!(top_k(&scores, 2, 0.0), vec![(1, 0.5), (3, 0.3)]);
        assert_eq!(top_k(&scores, 10, 0.1), vec![(1, 0.5), (3, 0.3), (0, 0.1)]);
        assert_eq!(top_k(&scores, 3, 0.9), vec![]);
        assert_eq!(
            top_k(&[0.2, f32::NAN, 0.2], 3, 0.0),
            vec![(0, 0.2), (2, 0.2)]
        );
    }

    #[test]
    fn softmax_is_stable_and_normalised() {
        let mut s = [1000.0, 1001.0, 999.0];
        softmax_in_place(&mut s);
        assert!((s.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(s[1] > s[0] && s[0] > s[2]);
        assert!(is_distribution(&s));
        assert!(!is_distribution(&[2.0, -1.0]));
        assert!(!is_distribution(&[0.9, 0.9]));
    }
}
