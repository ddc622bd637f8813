// SPDX-License-Identifier: MPL-2.0
//! The panels' tiles in x86 registers: AVX-512's 12 × 32 (its loop over a matrix's rows in
//! assembly, `rows_avx512`) and AVX2's 6 × 16, with the product in AVX-512 that `panels`
//! chooses at run time. Intrinsics that x86-64 alone compiles, apart from the blocking and
//! the tile dispatch in `panels`, which every target runs.

use std::ops::Range;

use super::rows_avx512;
use crate::kernels::panels::{AHEAD, Lhs, Operands, Panels, Start, WIDTH, run};
use crate::kernels::product::Product;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
pub(in crate::kernels) unsafe fn run_avx512(p: &Product, panels: &Panels, cols: Range<usize>) {
    run::<true, true>(p, panels, cols)
}

/// A tile in 8-wide registers, start to end: `R` × `W / 8` sums (up to twelve), the
/// panel's row in one or two, a broadcast of `x`; the bias, residual and clamp on the sums
/// in registers; masked loads and stores where the panel runs past the output's columns.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(in crate::kernels) unsafe fn tile_avx2<const R: usize, const W: usize>(at: &Operands) {
    use std::arch::x86_64::*;
    let v = W / 8;
    let full = at.cols == W;
    // SAFETY: the caller's (`Tile::sums`): masked loads and stores touch the first `cols`
    // columns only.
    unsafe {
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let mask = |j: usize| {
            let valid = at.cols.saturating_sub(8 * j) as i32;
            _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), lanes)
        };
        let masks = [mask(0), mask(1)];
        let get = |p: *const f32, j: usize| {
            if full {
                _mm256_loadu_ps(p.add(8 * j))
            } else {
                _mm256_maskload_ps(p.add(8 * j), masks[j])
            }
        };
        // As with AVX-512's tiles: the sums start from zero and take what they add to (the
        // output of the previous blocks of k, or the bias and the residual) after the loop,
        // so that the rows of those, asked for here, arrive while the loop runs. (Loaded
        // first, a residual's rows from memory stalled ResNet-50's short products: k = 64.)
        let added = match at.start {
            Start::Output => Some(at.y as *const f32),
            Start::Epilogue { residual, .. } => residual,
        };
        if let Some(z) = added {
            for r in 0..R {
                // A row's `W` values span at most two lines. A prefetch does not fault.
                let row = z.wrapping_add(r * at.y_stride);
                _mm_prefetch::<_MM_HINT_T0>(row as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(W - 1) as *const i8);
            }
        }
        let mut s = [[_mm256_setzero_ps(); 2]; R];
        let mut bi = at.b;
        for seg in 0..at.x.segments() {
            let (x, k) = at.x.segment::<R>(seg);
            for i in 0..k {
                // A line a step, or every other step for a panel of 8.
                if W == WIDTH || i % 2 == 0 {
                    _mm_prefetch::<_MM_HINT_T0>(bi.wrapping_add(AHEAD * W) as *const i8);
                }
                let w = [_mm256_loadu_ps(bi), _mm256_loadu_ps(bi.add(8 * (v - 1)))];
                for (r, row) in s.iter_mut().enumerate() {
                    let a = _mm256_broadcast_ss(&*x[r].add(i));
                    for (x, &w) in row.iter_mut().zip(&w).take(v) {
                        *x = _mm256_fmadd_ps(a, w, *x);
                    }
                    // A row's broadcast, then its products: left to itself, the compiler
                    // hoisted the broadcasts of a 5-row tile ahead of all the products, ran
                    // out of registers and kept three sums on the stack, which doubled the
                    // time of ResNet-50's 49-row layers. (An empty `asm!` that may touch
                    // memory is a fence to its scheduler, and costs nothing.)
                    std::arch::asm!("", options(nostack, preserves_flags));
                }
                bi = bi.add(W);
            }
        }
        let add_rows = |s: &mut [[__m256; 2]; R], z: *const f32| {
            for (r, row) in s.iter_mut().enumerate() {
                for (j, x) in row.iter_mut().take(v).enumerate() {
                    *x = _mm256_add_ps(*x, get(z.add(r * at.y_stride), j));
                }
            }
        };
        match at.start {
            Start::Output => add_rows(&mut s, at.y),
            Start::Epilogue { bias, residual } => {
                if let Some(bias) = bias {
                    let b = [get(bias, 0), get(bias, v - 1)];
                    for row in s.iter_mut() {
                        for (x, &b) in row.iter_mut().zip(&b).take(v) {
                            *x = _mm256_add_ps(*x, b);
                        }
                    }
                }
                if let Some(z) = residual {
                    add_rows(&mut s, z);
                }
            }
        }
        if let Some((lo, hi)) = at.clamp {
            let (lo, hi) = (_mm256_set1_ps(lo), _mm256_set1_ps(hi));
            for row in s.iter_mut() {
                for x in row.iter_mut().take(v) {
                    *x = _mm256_min_ps(_mm256_max_ps(*x, lo), hi);
                }
            }
        }
        for (r, row) in s.iter().enumerate() {
            let y = at.y.add(r * at.y_stride);
            for (j, &x) in row.iter().take(v).enumerate() {
                if full {
                    _mm256_storeu_ps(y.add(8 * j), x);
                } else {
                    _mm256_maskstore_ps(y.add(8 * j), masks[j], x);
                }
            }
        }
    }
}

/// A tile in 16-wide registers: `R` × `V` sums (up to 24), one panel's row or two panels'
/// (`b` and `b2`; the second may be a last panel of 8) in one or two registers, `steps`
/// values along k apart, broadcasts of `x`; masked loads and stores for the columns past
/// the output's.
///
/// # Safety
/// As `Tile::sums`; the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
pub(in crate::kernels) unsafe fn tile_avx512<const R: usize, const V: usize>(
    at: &Operands,
    b2: *const f32,
    steps: [usize; 2],
) {
    use std::arch::x86_64::*;
    let mask = |j: usize| -> __mmask16 {
        let valid = at.cols.saturating_sub(16 * j).min(16);
        ((1u32 << valid) - 1) as __mmask16
    };
    let masks = [mask(0), mask(1)];
    // SAFETY: the caller's: masked loads and stores touch the first `cols` columns only.
    unsafe {
        let get = |p: *const f32, j: usize| _mm512_maskz_loadu_ps(masks[j], p.add(16 * j));
        // The sums start from zero and take what they add to (the output of the previous
        // blocks of k, or the bias and the residual) after the loop: the rows of those,
        // asked for here, arrive from memory while the loop runs instead of stalling it.
        let added = match at.start {
            Start::Output => Some(at.y as *const f32),
            Start::Epilogue { residual, .. } => residual,
        };
        if let Some(z) = added {
            for r in 0..R {
                for j in 0..V {
                    // A prefetch does not fault; the address may pass the columns.
                    let line = z.wrapping_add(r * at.y_stride + 16 * j) as *const i8;
                    _mm_prefetch::<_MM_HINT_T0>(line);
                }
            }
        }
        let mut s = match (R, at.x) {
            // Twelve rows where they lie: in assembly (`rows_avx512`).
            (12, Lhs::Rows { x, stride, len }) => {
                // SAFETY: as above; a block of k is never empty (`k_blocks` of a k of at
                // least 1, which the plan's check requires).
                debug_assert!(len > 0);
                let sums = rows_avx512::sums::<V>(x, stride, len, [at.b, b2], steps);
                std::array::from_fn(|r| sums[r])
            }
            _ => sums_avx512::<R, V>(&at.x, [at.b, b2], steps),
        };
        match at.start {
            Start::Output => {
                for (r, row) in s.iter_mut().enumerate() {
                    for (j, x) in row.iter_mut().enumerate() {
                        *x = _mm512_add_ps(*x, get(at.y.add(r * at.y_stride), j));
                    }
                }
            }
            Start::Epilogue { bias, residual } => {
                if let Some(bias) = bias {
                    let mut b = [_mm512_setzero_ps(); V];
                    for (j, b) in b.iter_mut().enumerate() {
                        *b = get(bias, j);
                    }
                    for row in s.iter_mut() {
                        for (x, &b) in row.iter_mut().zip(&b) {
                            *x = _mm512_add_ps(*x, b);
                        }
                    }
                }
                if let Some(z) = residual {
                    for (r, row) in s.iter_mut().enumerate() {
                        for (j, x) in row.iter_mut().enumerate() {
                            *x = _mm512_add_ps(*x, get(z.add(r * at.y_stride), j));
                        }
                    }
                }
            }
        }
        if let Some((lo, hi)) = at.clamp {
            let (lo, hi) = (_mm512_set1_ps(lo), _mm512_set1_ps(hi));
            for row in s.iter_mut() {
                for x in row.iter_mut() {
                    *x = _mm512_min_ps(_mm512_max_ps(*x, lo), hi);
                }
            }
        }
        for (r, row) in s.iter().enumerate() {
            let y = at.y.add(r * at.y_stride);
            for (j, &x) in row.iter().enumerate() {
                _mm512_mask_storeu_ps(y.add(16 * j), masks[j], x);
            }
        }
    }
}

/// `tile_avx512`'s sums over the segments of `lhs`, from zero.
///
/// # Safety
/// As `tile_avx512`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn sums_avx512<const R: usize, const V: usize>(
    lhs: &Lhs,
    mut panels: [*const f32; 2],
    steps: [usize; 2],
) -> [[std::arch::x86_64::__m512; V]; R] {
    use std::arch::x86_64::*;
    let mut s = [[_mm512_setzero_ps(); V]; R];
    // SAFETY: the caller's.
    unsafe {
        for seg in 0..lhs.segments() {
            let (x, k) = lhs.segment::<R>(seg);
            for i in 0..k {
                for j in 0..V {
                    // Past the block's end this asks for what follows it: the panel's next
                    // block of k, or the next panel. A prefetch does not fault.
                    let ahead = panels[j].wrapping_add((i + AHEAD) * steps[j]);
                    _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
                }
                let mut w = [_mm512_setzero_ps(); V];
                for (j, w) in w.iter_mut().enumerate() {
                    // A panel of 8 is read with its 8 values only.
                    *w = _mm512_maskz_loadu_ps(
                        if steps[j] < 16 { 0xFF } else { 0xFFFF },
                        panels[j].add(i * steps[j]),
                    );
                }
                for (r, row) in s.iter_mut().enumerate() {
                    let a = _mm512_set1_ps(*x[r].add(i));
                    for (x, &w) in row.iter_mut().zip(&w) {
                        *x = _mm512_fmadd_ps(a, w, *x);
                    }
                }
            }
            panels = [0, 1].map(|j| panels[j].wrapping_add(k * steps[j]));
        }
    }
    s
}
