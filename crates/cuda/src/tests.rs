// SPDX-License-Identifier: MPL-2.0
//! The runtime's parts that need no GPU: activation parameters, the kernels' limits, the
//! kernels each family loads, and the kernels compiled with NVRTC where it is installed.

use super::{abi, runtime};
use trtclassify_compiler::ir::Act;
use trtclassify_compiler::plan::DType;

#[test]
fn an_fp16_floor_stays_positive() {
    // `x / max(‖x‖, 1e-12)`: the floor must not round to 0 in fp16, or a zero row gives 0/0.
    let clip = Act::Clip(1e-12, f32::MAX);
    let (_, lo, _) = abi::act_params(clip, DType::F16);
    assert!(half::f16::from_f32(lo).to_f32() > 0.0);
    assert_eq!(abi::act_params(clip, DType::F32).1, 1e-12);
    // Floors fp16 holds are kept.
    let (_, lo, _) = abi::act_params(Act::Clip(1e-3, 6.0), DType::F16);
    assert_eq!(lo, 1e-3);
}

/// The kernels take their sizes and ids from the Rust side (abi.rs's `prelude`), and no
/// kernel file defines one of them again; every activation and binary operation listed has
/// its function, and the generated `act` and `binop` call each by its name (NVRTC checks
/// that the functions exist; this checks what needs no NVRTC).
#[test]
fn the_kernels_take_their_ids_and_sizes_from_the_rust_side() {
    use trtclassify_compiler::ir::BinOp;
    let source = runtime::source();
    let prelude = abi::prelude();
    assert!(source.starts_with(&prelude));
    for name in [
        "MAX_RANK",
        "EW_SCALAR_CHUNK",
        "WARP_ROW_MAX",
        "SOFTMAX_WARP_MAX",
        "ROW_BLOCK",
        "PRE_SPAN",
    ] {
        assert_eq!(
            source.matches(&format!("#define {name} ")).count(),
            1,
            "{name} is defined once, by the prelude"
        );
    }
    assert!(prelude.contains(&format!("#define WARP_ROW_MAX {}\n", abi::WARP_ROW_MAX)));
    assert!(prelude.contains(&format!("#define ROW_BLOCK {}\n", abi::ROW_BLOCK)));
    assert!(prelude.contains(&format!("#define PRE_SPAN {}\n", abi::PRE_SPAN)));
    for name in abi::ACTIVATIONS {
        let function = format!("float act_{name}(float x, float p0, float p1)");
        assert!(source.contains(&function), "{function} is missing");
        let case = format!(
            "case ACT_{}: return act_{name}(x, p0, p1);",
            name.to_uppercase()
        );
        assert!(source.contains(&case), "{case} is missing");
    }
    for name in abi::BINARY_OPS {
        let function = format!("float binop_{name}(float a, float b)");
        assert!(source.contains(&function), "{function} is missing");
    }
    // The ids are the lists' positions, whatever the order of the compiler's enums.
    assert_eq!(abi::binop_id(BinOp::Add), 0);
    assert_eq!(abi::binop_id(BinOp::Min), 6);
    assert_eq!(abi::act_params(Act::None, DType::F32).0, 0);
    assert_eq!(abi::act_params(Act::Elu(1.0), DType::F32).0, 17);
    for layout in abi::FrameLayout::ALL {
        assert_eq!(abi::FrameLayout::from_id(layout.id()), Some(layout));
        let define = format!("#define FRAME_{} {}\n", layout.name(), layout.id());
        assert!(prelude.contains(&define), "{define}");
    }
    assert!(!source.contains("p.format == 0"), "frame layouts by name");
}

/// The kernels `cu` defines (`extern "C" __global__ void [__launch_bounds__(n[, m])] name(`),
/// those pasted together in a macro (`#define ATTENTION(DK, DV, WARPS, MIN_BLOCKS)`,
/// `attention_##DK##_##DV##_##WARPS##w(`) once for each line that expands it
/// (`ATTENTION(16, 32, 4, 1)`).
fn kernels_defined(cu: &str) -> Vec<String> {
    let mut kernels = Vec::new();
    for (at, _) in cu.match_indices("__global__ void ") {
        // Without C linkage the name would be mangled, and loading it by name would fail.
        let line = cu[at..].lines().next();
        assert!(cu[..at].ends_with("extern \"C\" "), "{line:?}");
        let rest = &cu[at + "__global__ void ".len()..];
        let rest = match rest.strip_prefix("__launch_bounds__(") {
            Some(rest) => rest.split_once(')').expect("launch bounds").1,
            None => rest,
        };
        // A macro's kernel may name itself on the next line (after a `\`).
        let rest = rest.trim_start_matches(|c: char| c.is_whitespace() || c == '\\');
        let name = rest.split_once('(').expect("a kernel's parameters").0;
        if !name.contains("##") {
            kernels.push(name.to_string());
            continue;
        }
        let define = cu[..at].rsplit_once("#define ").expect("a macro").1;
        let (macro_name, params) = define.split_once('(').expect("a macro's parameters");
        let (params, _) = params.split_once(')').expect("a macro's parameters");
        let params: Vec<&str> = params.split(',').map(str::trim).collect();
        for line in cu.lines() {
            let Some(args) = line
                .strip_prefix(macro_name)
                .and_then(|l| l.strip_prefix('('))
                .and_then(|l| l.strip_suffix(')'))
            else {
                continue;
            };
            let args: Vec<&str> = args.split(',').map(str::trim).collect();
            assert_eq!(args.len(), params.len(), "{line}");
            let piece = |piece| {
                params
                    .iter()
                    .position(|p| *p == piece)
                    .map_or(piece, |i| args[i])
            };
            kernels.push(name.split("##").map(piece).collect());
        }
    }
    kernels
}

/// Each family's kernel set loads exactly the kernels its `.cu` file defines (one it misses
/// would never run; one it names that the file lacks would fail every engine's loading), and
/// no other part of the source defines one.
#[test]
fn each_family_loads_the_kernels_its_file_defines() {
    let sorted = |mut names: Vec<String>| {
        names.sort();
        names
    };
    let mut all = Vec::new();
    for (file, cu, names) in runtime::kernel_families(DType::F16) {
        assert!(!names.is_empty(), "{file}");
        assert_eq!(sorted(kernels_defined(cu)), sorted(names.clone()), "{file}");
        all.extend(names);
    }
    assert_eq!(sorted(kernels_defined(runtime::source())), sorted(all));
    // Fused attention is fp16's only (attention.cu is within `#ifdef HALF`).
    for (file, _, names) in runtime::kernel_families(DType::F32) {
        assert_eq!(names.is_empty(), file == "steps/attention.cu", "{file}");
    }
}

#[test]
fn kernels_compile_with_nvrtc() {
    // NVRTC needs no GPU: where it is installed, the kernels are compiled for both types.
    // CI installs it (`TRTCLASSIFY_EXPECT_NVRTC`), so that a kernel that no longer compiles,
    // or a struct whose size no longer matches its Rust side, fails there.
    // SAFETY: only tries to dlopen the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        if std::env::var_os("TRTCLASSIFY_EXPECT_NVRTC").is_some() {
            panic!("kernels_compile_with_nvrtc: libnvrtc is expected here but cannot be loaded");
        }
        skipped("kernels_compile_with_nvrtc: libnvrtc is not installed here");
        return;
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .expect("nvrtcVersion");
    // Turing and Ampere servers, Jetson Orin (8.7), Hopper: what JetPack 6's CUDA 12.6 and
    // the GPU host's CUDA 13 must both compile for. CI runs this with NVRTC 12.2 (the oldest
    // supported), 12.6 (JetPack 6) and 13.0.
    let archs = [(7, 5), (8, 0), (8, 7), (9, 0)];
    for (dtype, arch) in [DType::F16, DType::F32]
        .into_iter()
        .flat_map(|d| archs.map(|a| (d, a)))
    {
        let compiled = runtime::compile(dtype, arch).unwrap_or_else(|e| {
            panic!(
                "NVRTC {major}.{minor}, {dtype:?}, sm_{}{}: {e}",
                arch.0, arch.1
            )
        });
        let ptx = &compiled.ptx;
        // TRTCLASSIFY_DUMP_KERNELS=DIR keeps the source and each PTX, to compare a change
        // to the kernels' files that should not change what they compile to.
        if let Some(dir) = std::env::var_os("TRTCLASSIFY_DUMP_KERNELS") {
            let dir = std::path::Path::new(&dir);
            std::fs::create_dir_all(dir).expect("dump folder");
            std::fs::write(dir.join("kernels.cu"), runtime::source()).expect("source written");
            let name = format!("{dtype:?}-sm_{}{}.ptx", arch.0, arch.1);
            std::fs::write(dir.join(name), ptx).expect("PTX written");
        }
        // Every kernel a context of this type loads, as each family's set names it: in the
        // PTX, and as a symbol of the machine code the engine keeps (an ELF file, whose
        // string table holds each name followed by a NUL).
        assert!(
            compiled.cubin.starts_with(b"\x7fELF"),
            "{dtype:?}: not a CUBIN"
        );
        // A string table may keep a name as the tail of a longer one (`.text.NAME`).
        let strings: Vec<&[u8]> = compiled.cubin.split(|&b| b == 0).collect();
        let symbol = |name: &str| {
            let dotted = format!(".{name}");
            (strings.iter()).any(|s| *s == name.as_bytes() || s.ends_with(dotted.as_bytes()))
        };
        for (file, _, names) in runtime::kernel_families(dtype) {
            for kernel in names {
                assert!(
                    ptx.contains(&format!(".entry {kernel}(")),
                    "{kernel} ({file}) missing from the PTX, {dtype:?}"
                );
                assert!(
                    symbol(&kernel),
                    "{kernel} ({file}) missing from the CUBIN, {dtype:?}"
                );
            }
        }
        // Fused attention is fp16's only; its tensor-core kernels hold mma.sync from sm_80 on.
        let attention = [
            ".entry attention_rows(",
            ".entry attention_64_64_4w(",
            ".entry attention_64_64_8w(",
        ];
        let mma = ptx.contains("mma.sync.aligned.m16n8k16");
        assert_eq!(
            attention.map(|a| ptx.contains(a)),
            [dtype == DType::F16; 3],
            "{dtype:?}"
        );
        assert_eq!(
            mma,
            dtype == DType::F16 && arch.0 >= 8,
            "{dtype:?} {arch:?}"
        );
    }
    // Shown in CI's log, beside the test counts.
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "NVRTC {major}.{minor}: the kernels compile for {archs:?} in fp16 and fp32"
    );
}

/// Says a test did not run, on stderr directly so that the harness does not capture it.
fn skipped(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {why}");
}

/// The element-wise kernels divide by a dimension with `fast_div` on `abi::divider`'s
/// multiplier and shift: exact for every 31-bit numerator.
#[test]
fn the_kernels_fast_division_is_exact() {
    let fast_div = |n: u32, (mul, shift): (u32, u32)| {
        let high = ((u64::from(n) * u64::from(mul)) >> 32) as u32;
        (high + n) >> shift
    };
    let mut divisors: Vec<u32> = (1..=1025).collect();
    divisors.extend([
        3 * 50176,
        50176,
        197,
        12_544,
        1 << 20,
        (1 << 30) + 1,
        i32::MAX as u32,
    ]);
    let mut n = 0x2545_f491u32;
    for &d in &divisors {
        let div = abi::divider(d);
        let edges = [
            0,
            1,
            d - 1,
            d,
            d + 1,
            2 * d - 1,
            i32::MAX as u32 - 1,
            i32::MAX as u32,
        ];
        for m in edges.into_iter().chain((0..300).map(|_| {
            // xorshift: numerators spread over the whole 31-bit range.
            n ^= n << 13;
            n ^= n >> 17;
            n ^= n << 5;
            n >> 1
        })) {
            let m = m.min(i32::MAX as u32);
            assert_eq!(fast_div(m, div), m / d, "{m} / {d}");
        }
    }
}

/// A step's chunks: a short last dimension is one chunk a row, and 32-bit indexing only
/// where every offset fits.
#[test]
fn element_wise_chunks_cover_each_row_once() {
    use trtclassify_compiler::ir::Act;
    use trtclassify_compiler::plan::{Loc, Strided};
    let strided = |strides: Vec<i64>| Strided {
        loc: Loc::Arena(0),
        strides,
    };
    // The input conversion: NCHW f32 to NHWC, [64, 224·224, 3].
    let dims = [64, 50176, 3];
    let nhwc = strided(vec![150_528, 3, 1]);
    let nchw = strided(vec![150_528, 1, 50176]);
    let p = abi::EwParams::new(None, Act::None, DType::F16, &dims, &nhwc, &nchw, None);
    let p = p.chunked(4);
    assert_eq!((p.chunk, p.parts, p.items, p.narrow), (3, 1, 64 * 50176, 1));
    // 16-byte chunks of a row of 768 halves.
    let rows = strided(vec![768, 1]);
    let p = abi::EwParams::new(None, Act::None, DType::F16, &[100, 768], &rows, &rows, None);
    let p = p.chunked(8);
    assert_eq!((p.chunk, p.parts, p.items), (8, 96, 9600));
    // A ragged last chunk: 10 = 4 + 4 + 2.
    let p = abi::EwParams::new(None, Act::None, DType::F16, &[5, 10], &rows, &rows, None);
    assert_eq!(p.chunked(4).parts, 3);
    // Offsets past 2^31 elements: 64-bit indexing.
    let far = strided(vec![1 << 31, 1]);
    let p = abi::EwParams::new(None, Act::None, DType::F16, &[2, 8], &far, &rows, None);
    assert_eq!(p.chunked(4).narrow, 0);
    // A scalar: one element.
    let p = abi::EwParams::new(None, Act::None, DType::F16, &[], &rows, &rows, None);
    let p = p.chunked(1);
    assert_eq!((p.items, p.chunk, p.rank), (1, 1, 1));
}

/// An 8-bit convolution's patches: dividers for each index the kernel splits, and 32-bit
/// indexing only where the patches and the input fit.
#[test]
fn patch_indexing_is_narrow_where_it_fits() {
    // ResNet-50's 3×3 convolutions of 256 channels at 14×14, batch 64: 9·32 groups a row.
    let conv = abi::PatchParams {
        shape: abi::ConvShape {
            rows: 64 * 196,
            h: 14,
            w: 14,
            c: 256,
            oh: 14,
            ow: 14,
            kh: 3,
            kw: 3,
            ..Default::default()
        },
        ..Default::default()
    };
    let p = conv.with_dividers(true);
    assert_eq!(
        p.div_mul[0..5],
        [288, 32, 3, 14, 14].map(|d| abi::divider(d).0)
    );
    assert_eq!((p.narrow, p.vec), (1, 1));
    // 2^31 groups of patches: 64-bit indexing.
    let wide = abi::PatchParams {
        shape: abi::ConvShape {
            rows: 1 << 28,
            ..conv.shape
        },
        ..conv
    };
    assert_eq!(wide.with_dividers(false).narrow, 0);
}
