#!/usr/bin/env bash
# Tiny dense GPT on the CPU (8 layers, width 64) on the demo corpus: the quality study's baseline.
source "$(dirname "$0")/recipe_settings.sh"
tiny_cpu_settings
LR=2.0e-3 MIN_LR=2.0e-4
run_recipe tiny-dense "$@"
