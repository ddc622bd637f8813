// SPDX-License-Identifier: MPL-2.0
//! The inner loop of the panels' tiles (`panels::accumulate`) in NEON registers: intrinsics
//! that aarch64 alone compiles, apart from the plain loop that the other targets run.

/// `accumulate` in 4-wide registers: up to 24 sums, the panel's row in four.
#[cfg(target_arch = "aarch64")]
pub(in crate::kernels) unsafe fn accumulate_neon<const R: usize, const W: usize>(
    acc: &mut [[f32; W]; R],
    k: usize,
    x: &[*const f32; R],
    b: *const f32,
) {
    use std::arch::aarch64::*;
    let v = W / 4;
    // SAFETY: the caller's.
    unsafe {
        let mut s = [[vdupq_n_f32(0.0); 4]; R];
        for (row, acc) in s.iter_mut().zip(acc.iter()) {
            for (j, x) in row.iter_mut().take(v).enumerate() {
                *x = vld1q_f32(acc.as_ptr().add(4 * j));
            }
        }
        for i in 0..k {
            let bi = b.add(i * W);
            let mut w = [vdupq_n_f32(0.0); 4];
            for (j, w) in w.iter_mut().take(v).enumerate() {
                *w = vld1q_f32(bi.add(4 * j));
            }
            for (r, row) in s.iter_mut().enumerate() {
                let a = vdupq_n_f32(*x[r].add(i));
                for (x, &w) in row.iter_mut().zip(&w).take(v) {
                    *x = vfmaq_f32(*x, a, w);
                }
            }
        }
        for (row, acc) in s.iter().zip(acc.iter_mut()) {
            for (j, &x) in row.iter().take(v).enumerate() {
                vst1q_f32(acc.as_mut_ptr().add(4 * j), x);
            }
        }
    }
}
