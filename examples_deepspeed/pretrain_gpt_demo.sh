#!/usr/bin/env bash
# The built-in demo, start to finish on the CPU: a corpus from the Python standard library's own
# sources, a SentencePiece tokenizer, Megatron's indexed dataset, then a few minutes of training
# a small MoE GPT (4 layers, 8 experts on every other layer, top-1) with evaluation, expert-load
# lines, TensorBoard logs and a checkpoint, and last a few lines generated from that checkpoint.
# Run it with `make demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
# $PYTHON (`make demo` passes its own), else an active virtual environment's, else the project's .venv
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=python3
    [[ -z ${VIRTUAL_ENV:-} && -x .venv/bin/python ]] && PYTHON=.venv/bin/python
fi
DEMO_DIR=${DEMO_DIR:-demo_output}
mkdir -p "$DEMO_DIR"

# Threads for this machine: torch's intra-op threads one per core (at most 8: a model this small
# gains nothing from more), idle threads sleeping instead of spinning (OMP_WAIT_POLICY=PASSIVE),
# so that on a shared or busy machine a step slows down in proportion instead of stalling while
# spinning threads wait for descheduled ones (measured on 2 loaded cores: 2 spinning threads took
# 2-7 s a step, 2 passive ones 1.5-2.3 s). Batches come from a memory-mapped index and cost little:
# a DataLoader worker process only where there are cores to spare for it (on 2 cores it took the
# same time a step and 100 MB more memory). Any of these set in the environment wins.
CORES=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CORES < 8 ? CORES : 8 ))}
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
LOADER_WORKERS=${DEMO_LOADER_WORKERS:-$(( CORES > 2 ? 1 : 0 ))}
PREPROCESS_WORKERS=$(( CORES < 4 ? CORES : 4 ))
echo "== $CORES cores: $OMP_NUM_THREADS torch threads, $LOADER_WORKERS DataLoader worker(s), $PREPROCESS_WORKERS preprocessing worker(s)"

echo "== 1/5 corpus"
[ -s "$DEMO_DIR/corpus.jsonl" ] || $PYTHON tools/build_demo_corpus.py --output "$DEMO_DIR/corpus.jsonl" --max-megabytes 8

echo "== 2/5 tokenizer"
[ -s "$DEMO_DIR/tokenizer.model" ] || $PYTHON tools/train_tokenizer.py --input "$DEMO_DIR/corpus.jsonl" \
    --json-keys text --vocab-size 4000 --model-type bpe --model-prefix "$DEMO_DIR/tokenizer"

echo "== 3/5 preprocessing"
[ -s "$DEMO_DIR/corpus_text_document.idx" ] || $PYTHON tools/preprocess_data.py --input "$DEMO_DIR/corpus.jsonl" \
    --json-keys text --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DEMO_DIR/tokenizer.model" \
    --append-eod --workers "$PREPROCESS_WORKERS" --output-prefix "$DEMO_DIR/corpus"

echo "== 4/5 training"
rm -rf "$DEMO_DIR/checkpoints" "$DEMO_DIR/tensorboard"
$PYTHON pretrain_gpt.py \
    --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 \
    --num-experts 8 --expert-interval 2 --topk 1 --moe-loss-coeff 0.01 \
    --moe-train-capacity-factor 1.0 --moe-eval-capacity-factor 1.0 --moe-min-capacity 4 \
    --micro-batch-size 8 --global-batch-size 16 --train-iters ${DEMO_ITERS:-200} \
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 10 \
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --hidden-dropout 0.0 --attention-dropout 0.0 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DEMO_DIR/tokenizer.model" \
    --data-path "$DEMO_DIR/corpus_text_document" --split 949,50,1 --num-workers "$LOADER_WORKERS" \
    --log-interval 5 --eval-interval 50 --eval-iters 4 --eval-at-start \
    --save "$DEMO_DIR/checkpoints" --tensorboard-dir "$DEMO_DIR/tensorboard"

echo "== 5/5 generation from the checkpoint (KV cache, MoE dropless)"
$PYTHON tools/generate.py --load "$DEMO_DIR/checkpoints" --max-new-tokens 40 \
    --temperature 0.8 --top-k 40 --seed 1234 \
    --prompt "def " --prompt "import os" --prompt "class "
