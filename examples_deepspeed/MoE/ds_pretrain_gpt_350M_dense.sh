#!/usr/bin/env bash
# GPT-3 Medium (350M), dense: the base model of the 350M MoE recipes.
source "$(dirname "$0")/recipe_settings.sh"
gpt3_size 350M
LR=3.0e-4 MIN_LR=3.0e-5
run_recipe gpt-350M-dense "$@"
