#!/usr/bin/env bash
# The GPU check, run as is on a lent GPU machine (under 9 minutes): the test suite's CUDA paths,
# then short bf16 and fp16 training runs of a ~125M GPT with tokens/s and MFU, then one MoE
# layer in bf16 (E=64, 16k tokens) with the grouped GEMM against its fallback, then async I/O
# of a GPU tensor through the op's locked bounce buffer, then (with 2 GPUs or more; one line
# and skipped with fewer) a tiny MoE GPT trained over NCCL with tensor, sequence and expert
# parallelism on 2 GPUs, which must end with a finite loss.
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
    timeout 60 $PY -m megatron.cli.ds_io $mode --gpu --io_size 1G --folder "$SCRATCH" 2>&1 | tee -a "$OUT/gpu_aio.log"
done
rm -rf "$SCRATCH"
echo "== tiny MoE GPT over NCCL on 2 GPUs: TP=2 + sequence parallel, EP=2 (dropless), 20 iterations"
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -lt 2 ]; then
    echo "skipped: $GPUS GPU(s) here, the TP=2 / EP=2 NCCL run needs 2" | tee "$OUT/gpu_tp_ep.log"
else
    DATA=$(mktemp -d -p "$PWD")  # the corpus, on the machine's disk, never inside $OUT
    # the tests' tiny flags (2 layers, h 32, seq 16, a random bigram corpus) with 4 experts; MoE
    # under TP requires --sequence-parallel; one flag or value a line, read into an array
    mapfile -t FLAGS < <($PY -c '
import sys
from pathlib import Path
from tests.training_fixtures import tiny_flags, write_corpus
print("\n".join(tiny_flags(write_corpus(Path(sys.argv[1])), num_experts=4, tensor_model_parallel_size=2,
                          sequence_parallel=True, moe_expert_parallel_size=2, disable_moe_token_dropping=True,
                          global_batch_size=4, train_iters=20, log_interval=5)))' "$DATA")
    timeout 120 $PY -m torch.distributed.run --standalone --nproc_per_node 2 pretrain_gpt.py "${FLAGS[@]}" 2>&1 \
        | tee "$OUT/gpu_tp_ep.log"
    rm -rf "$DATA"
    # the last training line's loss must be a number (the run stops itself at a non-finite one in fp32)
    $PY -c '
import math, re, sys
losses = re.findall(r"lm loss: (\S+)", open(sys.argv[1]).read())
if not losses or not math.isfinite(float(losses[-1])):
    sys.exit(f"error: the TP=2 / EP=2 run ended without a finite loss (last: {losses[-1:]}); see {sys.argv[1]}")
print(f"TP=2 / EP=2 over NCCL: final lm loss {float(losses[-1]):.4f}")' "$OUT/gpu_tp_ep.log" | tee -a "$OUT/gpu_tp_ep.log"
fi
