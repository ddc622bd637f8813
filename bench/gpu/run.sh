#!/usr/bin/env bash
# The GPU run, on the GPU host, from the repository root, after pack.sh (see
# bench/gpu/README.md). Stages, all by default:
#   tests    the cuda tests (engine, CUDA-memory input, shared engines; one at a time, then
#            side by side), the exports on the
#            cpu plan (engine tests), then the element, pipeline, scenario, memory,
#            reliability, failure and region tests with backend=cuda; a GPU is expected, so a
#            skip fails
#   engine   trtclassify-engine bench beside PyTorch (ResNet-50, MobileNetV2, EfficientNet-B0,
#            ViT-B/16, Swin-T)
#   streams  bench/gpu/streams.sh: 1 to 180 NVDEC streams, decode only and decode + classify
#   quick    a short streams check (8 and 64 streams, ResNet-50)
#   files    each torchvision model's engine file written, then loaded back: the checks on
#            engine files accept everything the build writes
#   families trtclassify-engine bench beside PyTorch for issue 13's other families (ViT-L,
#            Swin v2, MaxViT, DeiT, MobileViT, EfficientFormer, LeViT), batch 1 and 64
#   export   only the exports (all models) into /tmp/tv, for later stages run with
# SKIP_EXPORT=1, which reuses the exports of an earlier run in /tmp/tv.
# Logs go to $GPU_OUT (or /tmp/gpu-out); the tables come last. A failed step does not stop
# the run (the other stages still say what they can), but the run exits 1 at the end with a
# line naming every step that failed.
set -uo pipefail
. .gpu/gpu-env.sh >/dev/null
out=${GPU_OUT:-/tmp/gpu-out}
mkdir -p "$out" /tmp/tv
stages=${*:-tests engine streams}
has() { [[ " $stages " == *" $1 "* ]]; }
failed=()
# note STATUS WHAT: says how WHAT ended, and remembers it if it failed.
note() {
  local status=$1
  shift
  echo "$*: exit $status"
  [ "$status" -eq 0 ] || failed+=("$*")
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"

# timm (DeiT and the hybrids) and onnxscript (the dynamo exporter) are pure Python: their
# wheels travel in .gpu/files (pack.sh) and are unpacked here, the host being offline.
if compgen -G ".gpu/files/*.whl" >/dev/null; then
  python3 -m pip install -q --no-deps --target /tmp/pylib .gpu/files/*.whl >"$out/wheels.txt" 2>&1 ||
    { echo "wheels: $(tail -1 "$out/wheels.txt")"; failed+=("wheels"); }
  export PYTHONPATH=/tmp/pylib${PYTHONPATH:+:$PYTHONPATH}
fi
families=vit_l_16,swin_v2_t,maxvit_t,timm.deit_small_distilled_patch16_224,timm.mobilevit_xs,timm.mobilevitv2_050,timm.efficientformer_l1,timm.efficientformerv2_s0,timm.levit_128s,vit_b_16@14,swin_t@18,convnext_tiny@13,vit_b_16@dynamo,swin_t@dynamo,timm.levit_128s@dynamo
models=${MODELS:-resnet50,mobilenet_v2,efficientnet_b0,mobilenet_v3_small,squeezenet1_0,shufflenet_v2_x1_0,regnet_y_400mf,densenet121,convnext_tiny,vit_b_16,swin_t,$families}
has tests || has engine || has files || has families || has export || models=resnet50,mobilenet_v2
if [ -z "${SKIP_EXPORT:-}" ]; then
  python3 bench/gpu/torch_models.py export /tmp/tv --models "$models" > "$out/export.txt" 2>&1
  note $? "export"
  grep -E "export +[0-9]|failed" "$out/export.txt" | cut -c1-140
fi

if has tests; then
  export TRTCLASSIFY_MODELS_DIR=$PWD/models TRTCLASSIFY_CLIPS_DIR=$PWD/tests/clips \
    TRTCLASSIFY_TORCHVISION_DIR=/tmp/tv TRTCLASSIFY_EXPECT_GPU=1
  for t in /tmp/gpubin/cuda-*; do
    "$t" --nocapture --test-threads=1 >"$out/cuda-test.txt" 2>"$out/cuda-test.log"
    note $? "cuda tests"
    # Again side by side, as engines of one process are built and run: what one engine's
    # setup does to another's (a CUDA graph capture, cuDNN's algorithm search) shows here.
    "$t" >"$out/cuda-test-parallel.txt" 2>"$out/cuda-test-parallel.log"
    note $? "cuda tests in parallel"
    grep -E "^test result|panicked" "$out/cuda-test-parallel.txt" | head -5
  done
  grep -E "^test |largest|cached start|formats tested|decoders tested|runs in fp32|run in f32|came from|failed|panicked|SKIPPED" \
    "$out/cuda-test.txt" "$out/cuda-test.log" | cut -c1-300 | head -60
  # The CPU plan on the same exports against onnxruntime, and a thread's frames through the
  # batched tail against them one by one.
  for t in /tmp/gpubin/engine-*; do
    "$t" exported_families --nocapture >"$out/engine-test.txt" 2>"$out/engine-test.log"
    note $? "engine tests (exported families on the cpu plan)"
  done
  grep -E "largest|FAILED|panicked|failed" "$out/engine-test.log" | cut -c1-200 | head -60
  # The element's own tests on the GPU path: every element in them runs backend=cuda. A
  # binary missing from /tmp/gpubin fails too (the glob stays unexpanded: not found).
  for name in element pipeline scenarios live memory reliability failures regions; do
    for t in /tmp/gpubin/"$name"-*; do
      TRTCLASSIFY_TEST_BACKEND=cuda "$t" >"$out/$name-cuda.txt" 2>"$out/$name-cuda.log"
      note $? "$name tests with backend=cuda"
      grep '^test result' "$out/$name-cuda.txt"
      grep -E "FAILED|panicked" "$out/$name-cuda.txt" "$out/$name-cuda.log" | head -10
    done
  done
  unset TRTCLASSIFY_TEST_BACKEND TRTCLASSIFY_EXPECT_GPU
fi

if has files; then
  mkdir -p /tmp/engines
  for m in /tmp/tv/*.onnx; do
    e=/tmp/engines/$(basename "$m" .onnx).engine
    rm -f "$e"
    GST_DEBUG=trtclassify-engine:2 trtclassify-engine build "$m" --engine "$e" --batch-size 8 \
      >"$out/files.log" 2>&1 ||
      { echo "$m: build failed: $(tail -1 "$out/files.log")"; failed+=("files: $(basename "$m") build"); }
    GST_DEBUG=trtclassify-engine:4 trtclassify-engine build "$m" --engine "$e" --batch-size 8 \
      >"$out/files.log" 2>&1
    if grep -q "loaded engine file" "$out/files.log"; then
      echo "engine file $(basename "$e"): written and loaded back"
    else
      echo "engine file $(basename "$e"): NOT loaded back: $(grep -m1 -i 'engine file' "$out/files.log" | cut -c1-300)"
      failed+=("files: $(basename "$e") not loaded back")
    fi
  done
fi

if has engine; then
  bench_models=(/tmp/tv/{resnet50,mobilenet_v2,efficientnet_b0,vit_b_16,swin_t}.onnx)
  trtclassify-engine bench "${bench_models[@]}" --batches 1,8,64 --check --profile \
    >"$out/bench.md" 2>"$out/bench.log"
  note $? "trtclassify-engine bench"
  python3 bench/gpu/torch_models.py bench --models resnet50,mobilenet_v2,efficientnet_b0,vit_b_16,swin_t \
    --json "$out/torch_bench.json" >"$out/torch_bench.txt" 2>&1
  note $? "torch bench"
fi

family_bench=(vit_l_16 swin_v2_t maxvit_t timm.deit_small_distilled_patch16_224 timm.mobilevit_xs
  timm.efficientformer_l1 timm.levit_128s)
if has families; then
  paths=(); for m in "${family_bench[@]}"; do paths+=("/tmp/tv/$m.onnx"); done
  trtclassify-engine bench "${paths[@]}" --batches 1,64 --check \
    >"$out/families.md" 2>"$out/families.log"
  note $? "trtclassify-engine bench (families)"
  python3 bench/gpu/torch_models.py bench --models "$(IFS=,; echo "${family_bench[*]}")" --batches 1,64 \
    --json "$out/torch_families.json" >"$out/torch_families.txt" 2>&1
  note $? "torch bench (families)"
fi

header="| pipeline | streams | frames | frames out | PLAYING→EOS | frames/s | per stream | GPU busy | NVDEC busy | CPU busy | GPU memory | MiB/stream | in element p50 ms | p99 ms (median stream) | p99 ms (worst stream) | slowest ms (frame) | after start-up: p99 ms (median stream) | p99 ms (worst stream) | slowest ms (frame) | longest engine-lock wait ms | exit |"
rm -f "$out/streams.md"
# streams MODE STREAMS...: bench/gpu/streams.sh, remembered if one of its pipelines failed
# (its rows say which, in their exit column).
streams() {
  bench/gpu/streams.sh "$@" || failed+=("streams ${LABEL:+$LABEL: }$*")
}
if has quick; then
  streams decode 64
  streams resnet50 8 64
fi
if has streams; then
  for n in 1 8 32 64 128 180; do
    streams decode "$n"
    streams resnet50 "$n"
    streams mobilenet_v2 "$n"
  done
  # The old path (frames through host memory) and an engine per element, for comparison.
  streams download:resnet50 64
  streams own:resnet50 32
  # H.265 1080p and H.265 2160p.
  VIDEO=$PWD/.gpu/files/bench1080-h265.mp4 PARSE=h265parse DEC=nvh265dec LABEL=h265-decode \
    streams decode 64
  VIDEO=$PWD/.gpu/files/bench1080-h265.mp4 PARSE=h265parse DEC=nvh265dec LABEL=h265-resnet50 \
    streams resnet50 64
  VIDEO=$PWD/.gpu/files/bench2160-h265.mp4 FRAMES=300 PARSE=h265parse DEC=nvh265dec \
    LABEL=2160p-h265-decode streams decode 16
  VIDEO=$PWD/.gpu/files/bench2160-h265.mp4 FRAMES=300 PARSE=h265parse DEC=nvh265dec \
    LABEL=2160p-h265-resnet50 streams resnet50 16
fi

if has engine; then
  echo
  echo "== our engine (fp16) =="
  grep "^|" "$out/bench.md"
  echo
  echo "== PyTorch fp16 =="
  tail -22 "$out/torch_bench.txt"
fi
if has families; then
  echo
  echo "== families: our engine (fp16) =="
  grep "^|" "$out/families.md"
  echo
  echo "== families: PyTorch fp16 =="
  grep -v "^wrote" "$out/torch_families.txt" | tail -30
fi
if [ -s "$out/streams.md" ]; then
  echo
  echo "== streams: 1080p30 H.264 (unless said), NVDEC, trtclassify fp16 batch ${BATCH:-64} timeout ${TIMEOUT:-50} ms =="
  echo "$header"
  echo "$header" | sed 's/[^|]*|/---|/g; s/^---//' 
  cat "$out/streams.md"
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo
  joined=$(printf '%s; ' "${failed[@]}")
  echo "FAILED (${#failed[@]}): ${joined%; }"
  exit 1
fi
