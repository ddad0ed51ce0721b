#!/usr/bin/env bash
# Tiny modern MoE on the CPU, as today's open MoE models are built (GLM-4.5, DeepSeek-V3): SwiGLU, RMSNorm, no biases,
# untied output layer, GQA, rope; every layer MoE with 16 fine-grained experts (top-4) and a shared expert;
# sigmoid routing balanced by expert biases (aux-loss-free) plus a tiny sequence-wise aux loss; dropless.
# Exports to Hugging Face (GLM-4-MoE): python tools/checkpoint/convert.py --to hf --load CKPT --save DIR
source "$(dirname "$0")/recipe_settings.sh"
tiny_cpu_settings
EXPERTS=16 EXPERT_INTERVAL=1 TOPK=4 LR=2.0e-3 MIN_LR=2.0e-4 MOE_LOSS_COEFF=0.0001
MODEL_ARGS=(--swiglu --normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights
    --group-query-attention --num-query-groups 2 --position-embedding-type rope --ffn-hidden-size 176
    --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 32 --disable-moe-token-dropping
    --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-load-balancing-type seq_aux_loss)
run_recipe tiny-modern-MoE "$@"
