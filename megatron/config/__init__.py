"""Every input that configures a run, checked in one place: Megatron-style flags (flags.py), the
DeepSpeed-style JSON read through one mapping table (deepspeed_json.py) onto the runtime's schema
(megatron/runtime/config/), and the distillation flags (distill_flags.py)."""
