"""Every input that configures a run, checked in one place: Megatron-style flags (flags.py), the
DeepSpeed-style JSON read through one mapping table (deepspeed_json.py), the runtime's schema
(runtime_schema.py) and the distillation flags (distill_flags.py)."""
