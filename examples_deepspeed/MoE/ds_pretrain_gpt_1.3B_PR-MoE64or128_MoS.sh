#!/usr/bin/env bash
# 1.3B PR-MoE MoS: a 21-layer student (64 experts x 8 + 128 x 2, 27B parameters) distilled with
# staged KD from the 24-layer ds_pretrain_gpt_1.3B_PR-MoE64or128.sh checkpoint (train that first).
source "$(dirname "$0")/recipe_settings.sh"
gpt3_size 1.3B
NUM_LAYERS=21 EXPERTS="64 64 64 64 64 64 64 64 128 128" MLP_TYPE=residual LR=1.2e-4 MIN_LR=1.0e-6
TEACHER_EXPERTS="64 64 64 64 64 64 64 64 64 64 128 128"
mos_settings gpt-1.3B-PR-MoE64or128 24
run_recipe gpt-1.3B-PR-MoE64or128-MoS "$@"
