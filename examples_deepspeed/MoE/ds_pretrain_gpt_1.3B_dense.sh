#!/usr/bin/env bash
# GPT-3 XL (1.3B), dense: the base model of the 1.3B MoE recipes.
source "$(dirname "$0")/recipe_settings.sh"
gpt3_size 1.3B
LR=2.0e-4 MIN_LR=2.0e-5
run_recipe gpt-1.3B-dense "$@"
