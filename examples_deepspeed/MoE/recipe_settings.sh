# Settings shared by every ds_pretrain_gpt_*.sh in this folder, sourced by each of them: the
# published DeepSpeed-MoE training settings, the launcher, the ds_config writer and the choice of
# expert-parallel size. A recipe names its model (gpt3_size or tiny_cpu_settings, expert plan, LR,
# KD) and ends with `run_recipe NAME "$@"`; extra arguments go to pretrain_gpt.py.
#
# Environment: NNODES, NODE_RANK, GPUS_PER_NODE (default: the GPUs nvidia-smi lists, else 1),
# MASTER_ADDR (localhost), MASTER_PORT (6000), DATA_PATH, VOCAB_FILE, MERGE_FILE, OUTPUT_DIR,
# MICRO_BATCH_SIZE, ZERO_STAGE, OFFLOAD (none; cpu: Adam state in host memory; nvme: in swap files
# under NVME_PATH, default OUTPUT_DIR/swap, and with ZERO_STAGE=3 the parameters' master too; CPU
# training only), PYTHON; for MoS also TEACHER_DIR, MOS_KD=0 (the student alone) and
# KD_STOP_TOKENS (default: KD for the first 60% of training; "never" keeps it on). Tiny recipes:
# DEMO_DIR, TINY_TRAIN_TOKENS, TINY_EVAL_INTERVAL, TINY_PROCESSES. DRY_RUN=1 writes the ds_config and runs
# `pretrain_gpt.py --dry-run` (flags checked, model sized on the meta device) instead of training.
set -euo pipefail

RECIPE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$RECIPE_DIR/../.." && pwd)
# The interpreter: $PYTHON, else an active virtual environment's, else the project's .venv (what
# `make install` made), else python3; torchrun is run through it, so no PATH set-up is needed.
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=python3
    [[ -z ${VIRTUAL_ENV:-} && -x $REPO_DIR/.venv/bin/python ]] && PYTHON=$REPO_DIR/.venv/bin/python
fi

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)}
[[ ${GPUS_PER_NODE:-0} -gt 0 ]] || GPUS_PER_NODE=1
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
OUTPUT_DIR=${OUTPUT_DIR:-$REPO_DIR/output}

# Data: the paper trains on a Pile-like blend with GPT-2's BPE; point DATA_PATH at your
# preprocessed prefix (or "W1 PREFIX1 W2 PREFIX2 ...").
DATA_PATH=${DATA_PATH:-$REPO_DIR/data/pile_text_document}
VOCAB_FILE=${VOCAB_FILE:-$REPO_DIR/data/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-$REPO_DIR/data/gpt2-merges.txt}
TOKENIZER_ARGS=(--tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")
GPT2_VOCAB=50257  # GPT-2's BPE vocabulary, for sizing when its files are not here

# The paper's training settings (DeepSpeed-MoE, Rajbhandari et al. 2022, and its recipes)
SEQ_LEN=2048
TRAIN_TOKENS=300000000000
LR_DECAY_TOKENS=300000000000
LR_WARMUP_TOKENS=375000000
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
INIT_STD=0.014
TOPK=1
MOE_LOSS_COEFF=0.01
CAPACITY_FACTOR=1.0
MIN_CAPACITY=4
PRECISION=fp16
ZERO_STAGE_GIVEN=${ZERO_STAGE:-}
ZERO_STAGE=${ZERO_STAGE:-1}
OFFLOAD=${OFFLOAD:-none}
case $OFFLOAD in
    none | cpu | nvme) ;;
    *) echo "error: OFFLOAD=$OFFLOAD; use none, cpu or nvme" >&2; exit 1 ;;
esac
NVME_PATH=${NVME_PATH:-$OUTPUT_DIR/swap}
CHECKPOINT_ACTIVATIONS=true
SPLIT=98,2,0
LOG_INTERVAL=10
EVAL_INTERVAL=100
EVAL_ITERS=10
SAVE_INTERVAL=10000
EXTRA_ARGS=()

# A recipe's model; dense unless it sets EXPERTS (one count, or one per MoE layer); MODEL_ARGS
# holds Megatron-LM's model and router options beyond the DeepSpeed-MoE paper's
EXPERTS=1
EXPERT_INTERVAL=2
MLP_TYPE=standard
MODEL_ARGS=()
TEACHER_EXPERTS=""  # MoS: the teacher's expert plan (the EP size must divide it too)
KD_ARGS=()

# GPT-3 model sizes as the paper uses them: layers, hidden, heads, global batch
gpt3_size() {
    case $1 in
        125M) NUM_LAYERS=12 HIDDEN_SIZE=768 NUM_HEADS=12 GLOBAL_BATCH_SIZE=256 ;;
        350M) NUM_LAYERS=24 HIDDEN_SIZE=1024 NUM_HEADS=16 GLOBAL_BATCH_SIZE=256 ;;
        1.3B) NUM_LAYERS=24 HIDDEN_SIZE=2048 NUM_HEADS=16 GLOBAL_BATCH_SIZE=512 ;;
        *) echo "error: unknown model size $1; use 125M, 350M or 1.3B" >&2; exit 1 ;;
    esac
}

# The tiny CPU versions: the demo corpus and tokenizer (`make demo` builds them), 8 layers of
# width 64, fp32, one process, a few minutes of training on a 2-core machine.
tiny_cpu_settings() {
    DEMO_DIR=${DEMO_DIR:-$REPO_DIR/demo_output}
    if [[ ! -s $DEMO_DIR/corpus_text_document.idx || ! -s $DEMO_DIR/tokenizer.model ]]; then
        echo "error: no demo corpus in $DEMO_DIR; run \`make demo\` first (or set DEMO_DIR)" >&2
        exit 1
    fi
    DATA_PATH=$DEMO_DIR/corpus_text_document
    TOKENIZER_ARGS=(--tokenizer-type SentencePieceTokenizer --tokenizer-model "$DEMO_DIR/tokenizer.model")
    NUM_LAYERS=8 HIDDEN_SIZE=64 NUM_HEADS=4 SEQ_LEN=128
    MICRO_BATCH_SIZE=8 GLOBAL_BATCH_SIZE=8
    TRAIN_TOKENS=${TINY_TRAIN_TOKENS:-81920}  # 80 iterations of 8 x 128 tokens
    LR_DECAY_TOKENS=$TRAIN_TOKENS LR_WARMUP_TOKENS=8192
    INIT_STD=0.02 PRECISION=fp32 ZERO_STAGE=${ZERO_STAGE_GIVEN:-0} CHECKPOINT_ACTIVATIONS=false
    SPLIT=949,50,1 LOG_INTERVAL=10 EVAL_INTERVAL=${TINY_EVAL_INTERVAL:-10} EVAL_ITERS=4 SAVE_INTERVAL=1000000
    GPUS_PER_NODE=${TINY_PROCESSES:-1}
    EXTRA_ARGS=(--hidden-dropout 0.0 --attention-dropout 0.0 --num-workers 1 --eval-at-start)
}

# MoS (staged KD): distil from the checkpoint of recipe $1, whose $2 layers have the student's width
# and the expert plan TEACHER_EXPERTS. KD stops after 60% of the training tokens by default, as
# DeepSpeed's compression tutorial suggests ("disabling KD in the remaining 40% of training").
mos_settings() {
    local teacher=$1 teacher_layers=$2
    local stop=${KD_STOP_TOKENS:-$((TRAIN_TOKENS * 6 / 10))}
    [[ ${MOS_KD:-1} == 0 ]] && return
    # shellcheck disable=SC2206
    KD_ARGS=(--mos --load-teacher "${TEACHER_DIR:-$OUTPUT_DIR/checkpoint/$teacher}"
        --num-layers-teacher "$teacher_layers" --hidden-size-teacher "$HIDDEN_SIZE"
        --num-attention-heads-teacher "$NUM_HEADS" --num-experts-teacher $TEACHER_EXPERTS
        --mlp-type-teacher residual --kd-alpha-ce 1 --kd-beta-ce 1 --kd-temp 1.0)
    [[ $stop != never ]] && KD_ARGS+=(--kd-stop-tokens "$stop")
    return 0
}

gcd() {
    local a=$1 b=$2
    while ((b)); do local t=$((a % b)); a=$b; b=$t; done
    echo "$a"
}

# The largest expert-parallel size that divides the world size and every layer's expert count
# (student and teacher): the reference used the GPU count, which need not divide 32 experts.
pick_ep_size() {
    local world=$1 ep=$1 count
    shift
    for count in "$@"; do
        ((count > 1)) && ep=$(gcd "$ep" "$count")
    done
    echo "$ep"
}

# The zero_optimization block: the stage, and where OFFLOAD puts the optimizer state (and, under
# stage 3 with nvme, the parameters' master), in sub-groups of 1e7 elements moved through 3 buffers.
zero_config() {
    local nvme="\"device\": \"nvme\", \"nvme_path\": \"$NVME_PATH\""
    case $OFFLOAD in
        none) echo "{\"stage\": $ZERO_STAGE}" ;;
        cpu) echo "{\"stage\": $ZERO_STAGE, \"offload_optimizer\": {\"device\": \"cpu\"}}" ;;
        nvme)
            local params=""
            [[ $ZERO_STAGE == 3 ]] && params=", \"offload_param\": {$nvme, \"max_in_cpu\": 0}"
            echo "{\"stage\": $ZERO_STAGE, \"sub_group_size\": 10000000, \"offload_optimizer\": {$nvme, \"pipeline_read\": true, \"pipeline_write\": true, \"buffer_count\": 3}$params}" ;;
    esac
}

# The DeepSpeed JSON of this run: every value filled in, agreeing with the flags passed beside it.
write_ds_config() {
    local fp16=false bf16=false
    [[ $PRECISION == fp16 ]] && fp16=true
    [[ $PRECISION == bf16 ]] && bf16=true
    cat <<EOF
{
  "train_batch_size": $GLOBAL_BATCH_SIZE,
  "train_micro_batch_size_per_gpu": $MICRO_BATCH_SIZE,
  "gradient_clipping": 1.0,
  "zero_optimization": $(zero_config),
  "fp16": {"enabled": $fp16, "loss_scale": 0, "initial_scale_power": 11, "loss_scale_window": 500,
           "hysteresis": 2, "min_loss_scale": 1},
  "bf16": {"enabled": $bf16},
  "wall_clock_breakdown": false
}
EOF
}

run_recipe() {
    local name=$1
    shift
    local world=$((NNODES * GPUS_PER_NODE))
    # shellcheck disable=SC2086  # expert lists are space-separated on purpose
    local ep
    ep=$(pick_ep_size "$world" $EXPERTS $TEACHER_EXPERTS)
    mkdir -p "$OUTPUT_DIR/ds_config" "$OUTPUT_DIR/log"
    local config_json=$OUTPUT_DIR/ds_config/$name.json
    write_ds_config >"$config_json"
    local precision_flag=()
    [[ $PRECISION != fp32 ]] && precision_flag=(--"$PRECISION")
    local moe_args=()
    if [[ $EXPERTS != 1 ]]; then
        # shellcheck disable=SC2206
        moe_args=(--num-experts $EXPERTS --expert-interval "$EXPERT_INTERVAL" --topk "$TOPK" --mlp-type "$MLP_TYPE"
            --moe-expert-parallel-size "$ep" --moe-loss-coeff "$MOE_LOSS_COEFF"
            --moe-train-capacity-factor "$CAPACITY_FACTOR" --moe-eval-capacity-factor "$CAPACITY_FACTOR"
            --moe-min-capacity "$MIN_CAPACITY" --create-moe-param-group)
    fi
    [[ $CHECKPOINT_ACTIVATIONS == true ]] && EXTRA_ARGS+=(--checkpoint-activations)
    local args=(
        --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --num-attention-heads "$NUM_HEADS"
        --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN" --init-method-std "$INIT_STD"
        "${moe_args[@]}" "${MODEL_ARGS[@]}"
        --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
        --train-tokens "$TRAIN_TOKENS" --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine
        --lr-warmup-tokens "$LR_WARMUP_TOKENS" --lr-decay-tokens "$LR_DECAY_TOKENS"
        --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 "${precision_flag[@]}"
        --hysteresis 2 --zero-stage "$ZERO_STAGE"
        "${TOKENIZER_ARGS[@]}" --data-path $DATA_PATH --split "$SPLIT"
        --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
        --save "$OUTPUT_DIR/checkpoint/$name" --load "$OUTPUT_DIR/checkpoint/$name" --save-interval "$SAVE_INTERVAL"
        --tensorboard-dir "$OUTPUT_DIR/tensorboard/$name"
        --deepspeed --deepspeed_config "$config_json"
        "${KD_ARGS[@]}" "${EXTRA_ARGS[@]}"
    )
    if [[ -n ${DRY_RUN:-} ]]; then
        [[ ${TOKENIZER_ARGS[1]} == GPT2BPETokenizer && ! -f $VOCAB_FILE ]] && args+=(--vocab-size "$GPT2_VOCAB")
        echo "$name: $world rank(s), expert-parallel size $ep, ds_config $config_json"
        cd "$REPO_DIR" && WORLD_SIZE=$world "$PYTHON" pretrain_gpt.py "${args[@]}" --dry-run "$@"
        return
    fi
    echo "$name: $world rank(s) on $NNODES node(s), expert-parallel size $ep; log $OUTPUT_DIR/log/$name.log"
    cd "$REPO_DIR" && "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE" \
        --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
        pretrain_gpt.py "${args[@]}" "$@" 2>&1 | tee "$OUTPUT_DIR/log/$name.log"
}
