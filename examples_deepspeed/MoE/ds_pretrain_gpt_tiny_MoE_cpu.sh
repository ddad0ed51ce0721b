#!/usr/bin/env bash
# Tiny MoE on the CPU: the tiny dense model with 8 experts on every other layer, top-1 (same active FLOPs).
source "$(dirname "$0")/recipe_settings.sh"
tiny_cpu_settings
EXPERTS=8 LR=2.0e-3 MIN_LR=2.0e-4
run_recipe tiny-MoE "$@"
