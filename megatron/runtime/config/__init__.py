"""The runtime's DeepSpeed-style config: the strict schema of the keys that change the arithmetic
(schema.py), DeepSpeed's other keys accepted as hints or refused as not built (deepspeed_keys.py),
and the JSON/dict reader (config_file.py). It sits under runtime/ so that the runtime depends on
nothing above it; config/ maps Megatron flags onto it."""
