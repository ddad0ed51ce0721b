#!/usr/bin/env bash
# 1.3B PR-MoE: residual experts, 64 in the first ten MoE layers and 128 in the last two (31B parameters).
source "$(dirname "$0")/recipe_settings.sh"
gpt3_size 1.3B
EXPERTS="64 64 64 64 64 64 64 64 64 64 128 128" MLP_TYPE=residual LR=1.2e-4 MIN_LR=1.0e-6
run_recipe gpt-1.3B-PR-MoE64or128 "$@"
