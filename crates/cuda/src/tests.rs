// SPDX-License-Identifier: MPL-2.0
//! The runtime's parts that need no GPU: activation parameters, the kernels' limits, and the
//! kernels compiled with NVRTC where it is installed.

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

#[test]
fn warp_row_limit_matches_the_kernels() {
    let define = format!("#define WARP_ROW_MAX {}\n", abi::WARP_ROW_MAX);
    assert!(runtime::KERNELS.contains(&define), "kernels.cu: {define}");
}

#[test]
fn preprocessing_span_matches_the_kernels() {
    let define = format!("#define PRE_SPAN {}\n", abi::PRE_SPAN);
    assert!(runtime::KERNELS.contains(&define), "kernels.cu: {define}");
}

#[test]
fn kernel_ids_are_those_kernels_cu_switches_on() {
    use trtclassify_compiler::ir::BinOp;
    // `binop` in kernels.cu: `case 0: return a + b;` and so on.
    for (op, expr) in [
        (BinOp::Add, "a + b"),
        (BinOp::Sub, "a - b"),
        (BinOp::Mul, "a * b"),
        (BinOp::Div, "a / b"),
        (BinOp::Pow, "powf(a, b)"),
        (BinOp::Max, "fmaxf(a, b)"),
        (BinOp::Min, "fminf(a, b)"),
    ] {
        let case = format!("case {}: return {expr};", abi::binop_id(op));
        assert!(runtime::KERNELS.contains(&case), "kernels.cu: {case}");
    }
    // `act` in kernels.cu, for a few activations whose formula names them.
    for (act, expr) in [
        (Act::None, "return x;"),
        (Act::Relu, "return fmaxf(x, 0.f);"),
        (Act::Tanh, "return tanhf(x);"),
        (Act::Erf, "return erff(x);"),
        (Act::Sqrt, "return sqrtf(x);"),
        (Act::Neg, "return -x;"),
        (Act::Abs, "return fabsf(x);"),
    ] {
        let case = format!("case {}: {expr}", abi::act_params(act, DType::F32).0);
        assert!(runtime::KERNELS.contains(&case), "kernels.cu: {case}");
    }
    // `format` in kernels.cu's `struct Pre`.
    for layout in [
        abi::FrameLayout::Packed,
        abi::FrameLayout::Nv12,
        abi::FrameLayout::I420,
        abi::FrameLayout::P010,
    ] {
        assert_eq!(abi::FrameLayout::from_id(layout.id()), Some(layout));
    }
    let comment = "int format;                 // 0: packed RGB-like, 1: NV12, 2: I420, 3: P010";
    assert!(runtime::KERNELS.contains(comment), "kernels.cu: {comment}");
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
        let ptx = runtime::compile(dtype, arch).unwrap_or_else(|e| {
            panic!(
                "NVRTC {major}.{minor}, {dtype:?}, sm_{}{}: {e}",
                arch.0, arch.1
            )
        });
        for kernel in [
            "ew",
            "ew_from_f32",
            "bias_act",
            "pool_nhwc",
            "softmax_rows",
            "softmax_warp",
            "layernorm_warp",
            "layernorm_warp_vec",
            "preprocess_rows",
            "preprocess_cols",
        ] {
            assert!(
                ptx.contains(&format!(".entry {kernel}(")),
                "{kernel} missing"
            );
        }
        // Fused attention is fp16's only; its tensor-core kernels hold mma.sync from sm_80 on.
        let attention = [".entry attention_rows(", ".entry attention_64_64("];
        let mma = ptx.contains("mma.sync.aligned.m16n8k16");
        assert_eq!(
            attention.map(|a| ptx.contains(a)),
            [dtype == DType::F16; 2],
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
