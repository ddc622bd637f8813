// SPDX-License-Identifier: MPL-2.0
//! The int8 kernels run where there is no GPU: their source compiled as C++ for the CPU
//! emulator of `emulator/emu.h` (by the host's C++ compiler, `$CXX` or `c++`), with the
//! harness `emulator/quant_test.cpp`, which compares the own int8 kernels with the way
//! through cuBLASLt to the bit, in fp16 and in f32.

use std::path::Path;
use std::process::Command;

use crate::abi;

/// The kernels the harness runs, as `runtime::kernels::source` puts them together.
fn source() -> String {
    [
        abi::prelude().as_str(),
        include_str!("runtime/prelude.cu"),
        include_str!("runtime/steps/activations.cu"),
        abi::dispatchers().as_str(),
        include_str!("runtime/steps/quant.cu"),
    ]
    .join("\n")
}

/// The harness `name` built in `dir` for fp16 or f32 and run: its output.
fn build_and_run(dir: &Path, name: &str, half: bool) -> String {
    let binary = dir.join(format!("{name}-{}", if half { "fp16" } else { "f32" }));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let mut compile = Command::new(&cxx);
    compile
        .args([
            "-std=c++17",
            "-O2",
            "-ffp-contract=off",
            "-fno-strict-aliasing",
        ])
        .args([
            "-Wall",
            "-Wno-unused-variable",
            "-Wno-unused-but-set-variable",
            "-Wno-unknown-pragmas",
        ])
        .arg("-DTRTCLASSIFY_EMULATOR")
        .arg("-I")
        .arg(dir)
        .arg(dir.join(format!("{name}.cpp")))
        .arg("-o")
        .arg(&binary);
    if half {
        compile.arg("-DHALF");
    }
    let out = compile
        .output()
        .unwrap_or_else(|e| panic!("the C++ compiler {cxx} does not run: {e}"));
    assert!(
        out.status.success(),
        "{cxx} failed on the emulated kernels:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&binary).output().expect("the harness runs");
    let stdout = String::from_utf8_lossy(&run.stdout).into_owned();
    assert!(
        run.status.success(),
        "{name} ({}) failed:\n{stdout}{}",
        if half { "fp16" } else { "f32" },
        String::from_utf8_lossy(&run.stderr)
    );
    stdout
}

#[test]
fn the_own_int8_kernels_match_cublaslts_path() {
    let dir = tempfile::tempdir().expect("a temporary folder");
    for (file, text) in [
        ("kernels.cu", source().as_str()),
        ("emu.h", include_str!("../emulator/emu.h")),
        ("quant_test.cpp", include_str!("../emulator/quant_test.cpp")),
    ] {
        std::fs::write(dir.path().join(file), text).expect("the harness written");
    }
    for half in [true, false] {
        let out = build_and_run(dir.path(), "quant_test", half);
        print!("{out}");
        // 11 cases, each in the 6 ways of `EightBitKernel::OWN` × 2 orders of the copies.
        assert!(
            out.lines().last() == Some("emulated: 11 cases, 132 ways, 0 differ"),
            "{out}"
        );
    }
}
