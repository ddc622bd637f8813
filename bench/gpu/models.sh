# Sourced by the GPU host's timing scripts: `models` from the script's arguments, else
# ResNet-50 and ViT-B/16 from /tmp/tv; exits where one is missing.
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(/tmp/tv/resnet50.onnx /tmp/tv/vit_b_16.onnx)
for m in "${models[@]}"; do
    [ -e "$m" ] || { echo "$m: no such model (bench/gpu/torch_models.py export /tmp/tv)" >&2; exit 2; }
done
