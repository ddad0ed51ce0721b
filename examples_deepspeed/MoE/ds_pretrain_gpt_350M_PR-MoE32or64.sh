#!/usr/bin/env bash
# 350M PR-MoE: residual experts, 32 in the first ten MoE layers and 64 in the last two (4.0B parameters).
source "$(dirname "$0")/recipe_settings.sh"
gpt3_size 350M
EXPERTS="32 32 32 32 32 32 32 32 32 32 64 64" MLP_TYPE=residual LR=3.0e-4 MIN_LR=1.0e-6
run_recipe gpt-350M-PR-MoE32or64 "$@"
