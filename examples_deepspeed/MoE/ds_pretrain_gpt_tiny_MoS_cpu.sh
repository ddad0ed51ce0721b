#!/usr/bin/env bash
# Tiny MoS on the CPU: a 7-layer PR-MoE student (4 x 2 + 8 experts) distilled with staged KD from
# the tiny PR-MoE checkpoint (run ds_pretrain_gpt_tiny_PR-MoE_cpu.sh first).
source "$(dirname "$0")/recipe_settings.sh"
tiny_cpu_settings
NUM_LAYERS=7 EXPERTS="4 4 8" MLP_TYPE=residual LR=2.0e-3 MIN_LR=2.0e-4
TEACHER_EXPERTS="4 4 4 8"
mos_settings tiny-PR-MoE 8
run_recipe tiny-MoS "$@"
