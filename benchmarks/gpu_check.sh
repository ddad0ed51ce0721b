#!/usr/bin/env bash
# The GPU check, run as is on a lent GPU machine (under 8 minutes): the test suite's CUDA paths,
# then short bf16 and fp16 training runs of a ~125M GPT with tokens/s and MFU, then one MoE
# layer in bf16 (E=64, 16k tokens) with the grouped GEMM against its fallback, then async I/O
# of a GPU tensor through the op's locked bounce buffer.
# Results go to ${OUT:-benchmarks/results}; record them in docs/benchmarks.md.
#
# The GPU machine has its own python3 with torch and cannot reach a registry. If a dependency
# is missing there (pydantic was, in 2026-11), carry wheels: on the development machine run
#   pip download pydantic --only-binary=:all: --python-version 3.12 -d benchmarks/wheels
# and pass benchmarks/wheels in the device tool's carry list.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}

for module in pydantic safetensors sentencepiece tensorboard tqdm; do
    if ! $PY -c "import $module" 2>/dev/null; then
        $PY -m pip install --quiet --no-index --find-links benchmarks/wheels "$module"
    fi
done

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
echo "== CUDA paths of the test suite"
timeout 150 $PY -m pytest -q -m cuda tests 2>&1 | tee "$OUT/gpu_tests.log"
echo "== 125M training runs"
timeout 240 $PY -m benchmarks.gpu_train --output "$OUT/gpu_train.json" 2>&1 | tee "$OUT/gpu_train.log"
echo "== MoE layer, bf16, E=64, 16k tokens: grouped GEMM vs fallback vs dense"
timeout 90 $PY -m benchmarks.gpu_moe_layer --output "$OUT/gpu_moe_layer.json" 2>&1 | tee "$OUT/gpu_moe_layer.log"
echo "== async I/O of a GPU tensor through the locked bounce buffer (1 GiB)"
SCRATCH=$(mktemp -d -p "$PWD")  # on the machine's disk, never inside $OUT (which is copied back)
for mode in --write --read; do
    timeout 60 $PY -m megatron.ops.io_bench $mode --gpu --io_size 1G --folder "$SCRATCH" 2>&1 | tee -a "$OUT/gpu_aio.log"
done
rm -rf "$SCRATCH"
