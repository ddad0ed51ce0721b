#!/usr/bin/env bash
# 350M+MoE-128: 128 experts on every other layer, top-1 (13B parameters).
source "$(dirname "$0")/recipe_settings.sh"
gpt3_size 350M
EXPERTS=128 LR=2.0e-4 MIN_LR=2.0e-6
run_recipe gpt-350M-MoE128 "$@"
