#!/usr/bin/env bash
# Tiny PR-MoE on the CPU: residual experts, 4 in the first three MoE layers and 8 in the last; the MoS teacher.
source "$(dirname "$0")/recipe_settings.sh"
tiny_cpu_settings
EXPERTS="4 4 4 8" MLP_TYPE=residual LR=2.0e-3 MIN_LR=2.0e-4
run_recipe tiny-PR-MoE "$@"
