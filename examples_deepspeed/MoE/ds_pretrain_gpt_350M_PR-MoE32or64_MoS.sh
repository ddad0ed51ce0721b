#!/usr/bin/env bash
# 350M PR-MoE MoS: a 21-layer student (32 experts x 8 + 64 x 2, 3.5B parameters) distilled with
# staged KD from the 24-layer ds_pretrain_gpt_350M_PR-MoE32or64.sh checkpoint (train that first).
source "$(dirname "$0")/recipe_settings.sh"
gpt3_size 350M
NUM_LAYERS=21 EXPERTS="32 32 32 32 32 32 32 32 64 64" MLP_TYPE=residual LR=3.0e-4 MIN_LR=1.0e-6
TEACHER_EXPERTS="32 32 32 32 32 32 32 32 32 32 64 64"
mos_settings gpt-350M-PR-MoE32or64 24
run_recipe gpt-350M-PR-MoE32or64-MoS "$@"
