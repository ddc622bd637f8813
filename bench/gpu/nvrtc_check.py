#!/usr/bin/env python3
"""Compiles the kernels' source with NVRTC on the GPU host (fp16 and fp32), as the engine
does, and counts the vector loads and 64-bit divisions of the vectorised kernels: a quick
check of a kernel change before a full build. The source is put together by the cuda crate
(its files and what abi.rs generates); its NVRTC test writes it out:
`TRTCLASSIFY_DUMP_KERNELS=/tmp/k cargo test -p trtclassify-cuda --lib kernels_compile_with_nvrtc`
(with NVRTC installed), then: python3 bench/gpu/nvrtc_check.py /tmp/k/kernels.cu"""
import ctypes, glob, sys
lib = sorted(glob.glob('/usr/local/cuda/lib64/libnvrtc.so*'))[0]
nvrtc = ctypes.CDLL(lib)
src = open(sys.argv[1], 'rb').read()
for extra in ([b'-DHALF'], []):
    prog = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, b'kernels.cu', 0, None, None) == 0
    opts = [b'--gpu-architecture=compute_90'] + extra
    arr = (ctypes.c_char_p * len(opts))(*opts)
    r = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    print(extra, 'compile result', r, log.value.decode()[:3000])
    if r == 0:
        nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(n))
        ptx = ctypes.create_string_buffer(n.value)
        nvrtc.nvrtcGetPTX(prog, ptx)
        text = ptx.value.decode()
        import re
        for k in ('ew_vec', 'bias_act_vec', 'pool_nhwc_vec'):
            body = text[text.find('.entry ' + k):]
            body = body[:body.find('\n}')]
            print(k, 'v4 loads:', len(re.findall(r'ld\.global\.v4', body)), 'v4 stores:', len(re.findall(r'st\.global\.v4', body)), 'div.s64/rem.s64:', len(re.findall(r'(div|rem)\.s64', body)))
