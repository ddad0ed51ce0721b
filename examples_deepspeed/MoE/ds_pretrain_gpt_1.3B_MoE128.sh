#!/usr/bin/env bash
# 1.3B+MoE-128: 128 experts on every other layer, top-1 (52B parameters).
source "$(dirname "$0")/recipe_settings.sh"
gpt3_size 1.3B
EXPERTS=128 LR=1.2e-4 MIN_LR=1.0e-6
run_recipe gpt-1.3B-MoE128 "$@"
