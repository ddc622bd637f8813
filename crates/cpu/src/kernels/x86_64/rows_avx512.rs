// SPDX-License-Identifier: MPL-2.0
//! The sums of a 12-row AVX-512 tile over rows of a matrix that lie `stride` apart (a 1×1
//! convolution's pixels, a product's rows), its loop along k in assembly.
//!
//! Written with intrinsics, the loop wants a register for each of the twelve rows besides
//! the panels', the counter and the stack's: the compiler kept three of the rows on the
//! stack and read them back at every step (17 loads for 24 products), and it cannot be
//! told to address the rows from a few bases and the stride instead, as MLAS's kernels do.
//! Here four bases and the stride reach the twelve rows (`[base + stride]`,
//! `[base + 2*stride]`): ResNet-50's 1×1 layers of 3136 and 784 rows took 2–4 % less time,
//! the tile alone 3–7 % (Xeon; docs/benchmarks.md).

use std::arch::asm;
use std::arch::x86_64::*;

use crate::kernels::panels::AHEAD;

/// `Σ_i x[r][i] · b[i][..]` for the rows `r < 12` at `x + r · stride`, `k` steps, from zero:
/// `V` (1 or 2) registers of sums a row, for the panels at `panels`, `steps` values a step
/// (16, or 8 for a last panel, read with those only); with two, the first is a full one.
///
/// # Safety
/// The CPU has AVX-512F; `k ≥ 1`; `k` values at each row, `k` steps of each panel.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn sums<const V: usize>(
    x: *const f32,
    stride: usize,
    k: usize,
    panels: [*const f32; 2],
    steps: [usize; 2],
) -> [[__m512; V]; 12] {
    const { assert!(V == 1 || V == 2) };
    let lda = 4 * stride;
    let mask = |step: usize| -> __mmask16 { if step < 16 { 0xFF } else { 0xFFFF } };
    let (b, b2, step2, mask2) = match V {
        2 => (panels[0], panels[1], 4 * steps[1], mask(steps[1])),
        _ => (panels[0], panels[0], 4 * steps[0], mask(steps[0])),
    };
    let mut s = [_mm512_setzero_ps(); 24];
    // SAFETY: the caller's; the rows' bases are `x` plus 3, 6 and 9 strides, each read at 0,
    // 1 and 2 strides on; prefetches do not fault.
    unsafe {
        if V == 2 {
            asm!(
                "lea {c}, [{a} + 2*{lda}]",
                "add {c}, {lda}",
                "lea {d}, [{c} + 2*{lda}]",
                "add {d}, {lda}",
                "lea {e}, [{d} + 2*{lda}]",
                "add {e}, {lda}",
                "2:",
                "prefetcht0 [{b} + {ahead}]",
                "prefetcht0 [{b2} + {ahead2}]",
                "vmovups zmm24, [{b}]",
                "vmovups zmm25 {{{m}}}{{z}}, [{b2}]",
                "vbroadcastss zmm26, [{a}]",
                "vfmadd231ps zmm0, zmm26, zmm24",
                "vfmadd231ps zmm1, zmm26, zmm25",
                "vbroadcastss zmm27, [{a} + {lda}]",
                "vfmadd231ps zmm2, zmm27, zmm24",
                "vfmadd231ps zmm3, zmm27, zmm25",
                "vbroadcastss zmm28, [{a} + 2*{lda}]",
                "vfmadd231ps zmm4, zmm28, zmm24",
                "vfmadd231ps zmm5, zmm28, zmm25",
                "vbroadcastss zmm29, [{c}]",
                "vfmadd231ps zmm6, zmm29, zmm24",
                "vfmadd231ps zmm7, zmm29, zmm25",
                "vbroadcastss zmm30, [{c} + {lda}]",
                "vfmadd231ps zmm8, zmm30, zmm24",
                "vfmadd231ps zmm9, zmm30, zmm25",
                "vbroadcastss zmm31, [{c} + 2*{lda}]",
                "vfmadd231ps zmm10, zmm31, zmm24",
                "vfmadd231ps zmm11, zmm31, zmm25",
                "vbroadcastss zmm26, [{d}]",
                "vfmadd231ps zmm12, zmm26, zmm24",
                "vfmadd231ps zmm13, zmm26, zmm25",
                "vbroadcastss zmm27, [{d} + {lda}]",
                "vfmadd231ps zmm14, zmm27, zmm24",
                "vfmadd231ps zmm15, zmm27, zmm25",
                "vbroadcastss zmm28, [{d} + 2*{lda}]",
                "vfmadd231ps zmm16, zmm28, zmm24",
                "vfmadd231ps zmm17, zmm28, zmm25",
                "vbroadcastss zmm29, [{e}]",
                "vfmadd231ps zmm18, zmm29, zmm24",
                "vfmadd231ps zmm19, zmm29, zmm25",
                "vbroadcastss zmm30, [{e} + {lda}]",
                "vfmadd231ps zmm20, zmm30, zmm24",
                "vfmadd231ps zmm21, zmm30, zmm25",
                "vbroadcastss zmm31, [{e} + 2*{lda}]",
                "vfmadd231ps zmm22, zmm31, zmm24",
                "vfmadd231ps zmm23, zmm31, zmm25",
                "add {a}, 4",
                "add {c}, 4",
                "add {d}, 4",
                "add {e}, 4",
                "add {b}, 64",
                "add {b2}, {step2}",
                "dec {k}",
                "jnz 2b",
                a = inout(reg) x => _,
                lda = in(reg) lda,
                k = inout(reg) k => _,
                b = inout(reg) b => _,
                b2 = inout(reg) b2 => _,
                step2 = in(reg) step2,
                ahead = const 64 * AHEAD,
                ahead2 = in(reg) step2 * AHEAD,
                m = in(kreg) mask2,
                c = out(reg) _,
                d = out(reg) _,
                e = out(reg) _,
                inout("zmm0") s[0], inout("zmm1") s[1], inout("zmm2") s[2],
                inout("zmm3") s[3], inout("zmm4") s[4], inout("zmm5") s[5],
                inout("zmm6") s[6], inout("zmm7") s[7], inout("zmm8") s[8],
                inout("zmm9") s[9], inout("zmm10") s[10], inout("zmm11") s[11],
                inout("zmm12") s[12], inout("zmm13") s[13], inout("zmm14") s[14],
                inout("zmm15") s[15], inout("zmm16") s[16], inout("zmm17") s[17],
                inout("zmm18") s[18], inout("zmm19") s[19], inout("zmm20") s[20],
                inout("zmm21") s[21], inout("zmm22") s[22], inout("zmm23") s[23],
                out("zmm24") _, out("zmm25") _, out("zmm26") _, out("zmm27") _,
                out("zmm28") _, out("zmm29") _, out("zmm30") _, out("zmm31") _,
                options(nostack, readonly),
            );
        } else {
            // One panel: its values at `b2`, `step2` a step, as a pair's second.
            asm!(
                "lea {c}, [{a} + 2*{lda}]",
                "add {c}, {lda}",
                "lea {d}, [{c} + 2*{lda}]",
                "add {d}, {lda}",
                "lea {e}, [{d} + 2*{lda}]",
                "add {e}, {lda}",
                "2:",
                "prefetcht0 [{b2} + {ahead2}]",
                "vmovups zmm24 {{{m}}}{{z}}, [{b2}]",
                "vfmadd231ps zmm0, zmm24, [{a}]{{1to16}}",
                "vfmadd231ps zmm1, zmm24, [{a} + {lda}]{{1to16}}",
                "vfmadd231ps zmm2, zmm24, [{a} + 2*{lda}]{{1to16}}",
                "vfmadd231ps zmm3, zmm24, [{c}]{{1to16}}",
                "vfmadd231ps zmm4, zmm24, [{c} + {lda}]{{1to16}}",
                "vfmadd231ps zmm5, zmm24, [{c} + 2*{lda}]{{1to16}}",
                "vfmadd231ps zmm6, zmm24, [{d}]{{1to16}}",
                "vfmadd231ps zmm7, zmm24, [{d} + {lda}]{{1to16}}",
                "vfmadd231ps zmm8, zmm24, [{d} + 2*{lda}]{{1to16}}",
                "vfmadd231ps zmm9, zmm24, [{e}]{{1to16}}",
                "vfmadd231ps zmm10, zmm24, [{e} + {lda}]{{1to16}}",
                "vfmadd231ps zmm11, zmm24, [{e} + 2*{lda}]{{1to16}}",
                "add {a}, 4",
                "add {c}, 4",
                "add {d}, 4",
                "add {e}, 4",
                "add {b2}, {step2}",
                "dec {k}",
                "jnz 2b",
                a = inout(reg) x => _,
                lda = in(reg) lda,
                k = inout(reg) k => _,
                b2 = inout(reg) b2 => _,
                step2 = in(reg) step2,
                ahead2 = in(reg) step2 * AHEAD,
                m = in(kreg) mask2,
                c = out(reg) _,
                d = out(reg) _,
                e = out(reg) _,
                inout("zmm0") s[0], inout("zmm1") s[1], inout("zmm2") s[2],
                inout("zmm3") s[3], inout("zmm4") s[4], inout("zmm5") s[5],
                inout("zmm6") s[6], inout("zmm7") s[7], inout("zmm8") s[8],
                inout("zmm9") s[9], inout("zmm10") s[10], inout("zmm11") s[11],
                out("zmm24") _,
                options(nostack, readonly),
            );
        }
    }
    std::array::from_fn(|r| std::array::from_fn(|j| s[r * V + j]))
}
