#!/usr/bin/env bash
# GPT-3 Small (125M) with 64 experts on every other layer, top-1.
source "$(dirname "$0")/recipe_settings.sh"
gpt3_size 125M
EXPERTS=64 LR=4.5e-4 MIN_LR=4.5e-6
run_recipe gpt-125M-MoE64 "$@"
