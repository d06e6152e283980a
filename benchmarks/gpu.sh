#!/usr/bin/env bash
# Every GPU figure in one run, sized for <= 8 minutes on one H200, using only what a CUDA image
# with torch and triton has (no installs): FP8 vs BF16 GEMM TFLOP/s, quantize throughput, and the
# training step of a ~1B-parameter GPT (24 layers x 2048 wide, 8 x 1024 tokens) under
# torch.compile for BF16 autocast, torchao float8 and fp8lm O1 / O2, with state and activation bytes;
# the distributed CLI on one GPU with NCCL (nccl_world1.py); and each recipe's layer against its
# emulation (recipe_layers.py); the compiled quantization against eager (compiled_quantize_check.py).
#
#   bash benchmarks/gpu.sh [OUT_DIR]          # JSON files in OUT_DIR (default benchmarks/results/gpu)
#   FP8LM_GPU_SMOKE=1 bash benchmarks/gpu.sh  # the same scripts at toy sizes on CPU, to check them
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/results/gpu}
mkdir -p "$out"
export PYTHONPATH="$here/../src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
cd "$here"

if [ "${FP8LM_GPU_SMOKE:-0}" = 1 ]; then
  gemm=(--device cpu --shapes 256x128x256 --reps 2)
  quant=(--device cpu --mb 16 --reps 2)
  train=(--device cpu --sizes 2x128 --levels bf16,O1,O2 --batch 2 --seq 64 --rounds 1 --steps 1 --warmup 1)
  opt=(--device cpu --layers 1 --width 64 --steps 2 --warmup 1 --skip-eager)
  nccl=(--device cpu --steps 4)
  layers=(--device cpu --tokens 256 --width 128 --reps 2 --backend scaled_mm)
  check=(--device cpu --recipes blockwise)
else
  gemm=()
  quant=(--mb 1024)
  # torchao float8 (compiled, tensorwise) is the peer where it is installed; skipped, and said so, where not.
  train=(--sizes 24x2048 --levels bf16,torchao,O1,O2 --batch 8 --seq 1024 --compile --rounds 3 --steps 3 --warmup 2)
  opt=(--layers 24 --width 2048 --steps 10 --skip-eager)
  nccl=(--device cuda --steps 20)
  layers=(--tokens 8192 --width 4096)
  check=(--recipes blockwise,nvfp4)
fi

status=0
run() {  # name, time limit (s), script and arguments: JSON to $out/name.json, log beside it
  local name=$1 limit=$2; shift 2
  echo "== $name" >&2
  if timeout "$limit" "$py" "$@" >"$out/$name.json" 2>"$out/$name.log"; then
    echo "   ok" >&2
  else
    echo "   FAILED (exit $?), see $out/$name.log" >&2; tail -5 "$out/$name.log" >&2; status=1
  fi
}
run gemm 150 gemm.py "${gemm[@]}"  # nvfp4's quantization and layouts compile once
run quantize 60 quantize.py "${quant[@]}"
run optimizer_step 90 optimizer_step.py "${opt[@]}"
run train_step_1b 270 train_step.py "${train[@]}"
# the distributed CLI on NCCL (world size 1: every collective of the step, on the GPU)
run nccl_world1 120 nccl_world1.py "${nccl[@]}"
# each recipe's layer against its emulation on the device (compiled quantization, real kernels)
run recipe_layers 120 recipe_layers.py "${layers[@]}"
# the compiled quantization and a compiled layer against eager, shapes the blocks do not divide
# included (inductor's CPU code got those wrong)
run compiled_quantize_check 120 compiled_quantize_check.py "${check[@]}"
exit $status
