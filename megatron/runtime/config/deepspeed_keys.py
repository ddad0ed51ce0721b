"""The rest of DeepSpeed 0.19's config keys, so that a user's ds_config.json loads as written.

schema.py models the keys that change the arithmetic. The keys here are the others, each
either a hint that changes nothing in this runtime (accepted; one log line says so and why) or a
feature that is not built here (refused with one sentence once it is turned on; the same block
turned off is accepted). Their fields live in the mixins below, which the schema's sections
inherit, so that a misspelled one still gets the nearest-key suggestion.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import AliasChoices, BaseModel, Field, model_validator

from megatron.errors import ConfigError
from megatron.runtime.config.schema_types import Block, Count, PositiveCount, Section

Path = tuple[str, ...]


@dataclass(frozen=True)
class Hint:
    """A key accepted without effect here, and why it has none."""

    path: Path
    why: str
    applies: Callable[[Any], bool] = lambda value: True  # the value given decides for some keys


@dataclass(frozen=True)
class Unbuilt:
    """A feature not built here: refused when `is_on` holds for the key's value."""

    path: Path
    feature: str
    is_on: Callable[[Any], bool]
    instead: str = ""  # what to use instead, where this toolkit has it


def _enabled(block: Any) -> bool:
    return isinstance(block, dict) and block.get("enabled") is True


def _any_enabled(block: Any) -> bool:
    """Some feature inside a nested block (compression_training) is on."""
    if isinstance(block, dict):
        return block.get("enabled") is True or any(_any_enabled(inner) for inner in block.values())
    return False


def no_data_efficiency_feature(block: Any) -> bool:
    """Neither random-LTD nor curriculum sampling is on in a typed data_efficiency block."""
    return block.random_ltd is None and block.curriculum_sampling is None


def _is_true(value: Any) -> bool:
    return value is True


def _above_one(value: Any) -> bool:
    return value is not None and value > 1


def _mock(kind: Any) -> bool:
    return kind == "mock"


def _given(value: Any) -> bool:
    return value is not None


def _reduced_precision(value: Any) -> bool:
    return value is not None and value.lower() not in ("fp32", "float32", "float", "torch.float32")


def _reduced_precision_types(block: Any) -> bool:
    return isinstance(block, dict) and any(
        _reduced_precision(block.get(key)) for key in ("grad_accum_dtype", "param_dtype", "buffer_dtype")
    )


def _deep_compile(block: Any) -> bool:
    return isinstance(block, dict) and block.get("deepcompile") is True


def _client_boundaries(value: Any) -> bool:
    return value is False


def _autotp(block: Any) -> bool:
    return isinstance(block, dict) and (block.get("autotp_size") or 0) > 1


HINTS: tuple[Hint, ...] = (
    Hint(("zero_allow_untested_optimizer",), "ZeRO here partitions the state of any torch optimizer"),
    Hint(("data_efficiency",), "curriculum learning and random-LTD are both off in it", no_data_efficiency_feature),
    Hint(("zero_force_ds_cpu_optimizer",), "CPU offload always steps the toolkit's native CPU Adam"),
    Hint(
        ("disable_allgather",),
        "DeepSpeed then broadcasts the updated partitions instead; the parameters come out the same",
    ),
    Hint(("dump_state",), "a DeepSpeed debugging print of its engine's state"),
    Hint(("disable_python_gc",), "a DeepSpeed knob for when Python's garbage collector runs"),
    Hint(("memory_breakdown",), "DeepSpeed's accelerator-memory print, which this engine does not make"),
    Hint(
        ("vocabulary_size",),
        "DeepSpeed only warns about its alignment; --make-vocab-size-divisible-by pads the vocabulary",
    ),
    Hint(
        ("dataloader_drop_last",),
        "the engine builds no data loader; the trainer's sampler always drops an incomplete last batch",
    ),
    Hint(("log_level",), "DeepSpeed's logger level; the toolkit logs through its own Megatron-style lines"),
    Hint(("managed_gradient_accumulation",), "the engine counts micro-batches and steps at the boundary, as true asks"),
    Hint(("seq_parallel_communication_data_type",), "Ulysses sequence parallelism is not built"),
    Hint(("allgather_size",), "it sizes buckets only beside a boolean zero_optimization"),
    Hint(("pipeline",), "DeepSpeed's PipelineEngine reads it; pipeline parallelism is not built"),
    Hint(("checkpoint", "tag_validation"), "every rank's files are checked against the manifest when loaded"),
    Hint(("checkpoint", "load_universal"), "checkpoints here load under any layout without a conversion"),
    Hint(("checkpoint", "use_node_local_storage"), "every rank writes its own files into the one --save folder"),
    Hint(("checkpoint", "parallel_write"), "every rank writes its own files here"),
    Hint(("checkpoint", "checkpoint_serialization"), "checkpoints here are safetensors files, never pickled"),
    Hint(("checkpoint", "writer", "show_statistics"), "each save's log line gives its time"),
    Hint(("timers",), "DeepSpeed's throughput timers; the trainer's log lines report throughput"),
    Hint(("compile",), "settings of DeepSpeed's torch.compile integration"),
    Hint(("activation_checkpointing",), "--checkpoint-activations turns checkpointing on, as in Megatron-DeepSpeed"),
    Hint(
        ("activation_checkpointing", "partition_activations"),
        "it splits activations over tensor-parallel ranks; there is one",
    ),
    Hint(("activation_checkpointing", "contiguous_memory_optimization"), "an accelerator memory-layout hint"),
    Hint(("activation_checkpointing", "number_checkpoints"), "it sizes contiguous_memory_optimization's buffers"),
    Hint(("activation_checkpointing", "synchronize_checkpoint_boundary"), "an accelerator synchronisation for timing"),
    Hint(("activation_checkpointing", "profile"), "DeepSpeed's timing prints of checkpointed layers"),
    Hint(("activation_checkpointing", "cpu_checkpointing"), "activations already live in host memory on the CPU"),
    Hint(("optimizer", "legacy_fusion"), "a switch of DeepSpeed's fused fp16 optimizer"),
    Hint(("fp16", "auto_cast"), "the forward runs under torch.autocast, which casts each operation's inputs"),
    Hint(("bf16", "immediate_grad_update"), "gradients here are reduced and applied at the accumulation boundary"),
    Hint(("bf16", "check_grad_overflow"), "non-finite gradients are always detected here (see --check-for-nan)"),
    *(
        Hint(("zero_optimization", key), why)
        for key, why in (
            (
                "allgather_partitions",
                "DeepSpeed then broadcasts partitions instead of gathering them; the values are the same",
            ),
            ("use_multi_rank_bucket_allreduce", "a choice among DeepSpeed's all-reduce implementations"),
            ("compute_grad_norm", "the gradient norm is always computed here, for clipping and the log"),
            ("load_from_fp32_weights", "checkpoints here hold the fp32 weights, which are always loaded"),
            ("elastic_checkpoint", "checkpoints here load under any data-parallel size"),
            ("stage3_model_persistence_threshold", "a ZeRO-3 memory hint for small parameters"),
            (
                "stage3_max_reuse_distance",
                "a ZeRO-3 hint for keeping gathered parameters; each module's are freed after use",
            ),
            ("stage3_module_granularity_threshold", "a ZeRO-3 hint for fetching parameters by module"),
            ("stage3_use_all_reduce_for_fetch_params", "a choice of collective for gathering parameters"),
            ("stage3_allgather_sequential", "a choice of collective order for gathering parameters"),
            ("ignore_unused_parameters", "parameters with no gradient get a zero gradient here"),
            ("legacy_stage1", "DeepSpeed's old stage-1 implementation"),
            ("round_robin_gradients", "an order of gradient copies for CPU offload"),
            ("parameter_alignment", "an alignment of DeepSpeed's flat buffers"),
            ("memory_efficient_linear", "DeepSpeed's ZeRO-3 linear layer wrapper"),
            ("pipeline_loading_checkpoint", "a ZeRO-3 loading order for pipeline parallelism"),
            ("override_module_apply", "DeepSpeed's ZeRO-3 hook on Module.apply"),
            ("log_trace_cache_warnings", "DeepSpeed's ZeRO-3 prefetch trace warnings"),
            ("enable_sanity_checks", "DeepSpeed's ZeRO-3 internal checks"),
            ("save_muon_momentum_buffer_in_memory", "the Muon optimizer is not built"),
            ("leaf_module", "a ZeRO-3 fetch-granularity hint"),
            ("cpu_offload_use_pin_memory", "host buffers here are always the aio op's locked ones"),
        )
    ),
    *(
        Hint(("zero_optimization", "offload_optimizer", key), why)
        for key, why in (
            ("ratio", "the whole optimizer step runs on the CPU when offloaded"),
            ("super_offload", "a scheduling mode of DeepSpeed's CPU optimizer"),
            ("cpuadam_cores_perc", "the native CPU Adam uses torch's thread count"),
        )
    ),
)

UNBUILT: tuple[Unbuilt, ...] = (
    *(
        Unbuilt((key,), feature, _enabled)
        for key, feature in (
            ("wandb", "Weights & Biases logging"),
            ("csv_monitor", "the CSV monitor"),
            ("comet", "Comet logging"),
            ("hybrid_engine", "the RLHF hybrid engine"),
            ("elasticity", "elastic training"),
            ("nebula", "Nebula checkpointing"),
            ("amp", "Apex AMP"),
            ("quantize_training", "quantized training (MoQ)"),
            ("eigenvalue", "eigenvalue computation"),
            ("progressive_layer_drop", "progressive layer dropping"),
        )
    ),
    Unbuilt(("expert_parallel",), "AutoEP", _enabled, "set --moe-expert-parallel-size"),
    Unbuilt(
        ("torch_autocast",),
        "torch_autocast",
        _enabled,
        "use the fp16 or bf16 block, which runs the forward under autocast",
    ),
    Unbuilt(("compression_training",), "the compression library", _any_enabled),
    Unbuilt(("sparse_attention",), "sparse attention", _given),
    Unbuilt(("weight_quantization",), "weight quantization", _given),
    Unbuilt(("datastates_ckpt",), "DataStates checkpointing", _given),
    Unbuilt(("tensor_parallel",), "AutoTP tensor parallelism", _autotp),
    Unbuilt(("compile",), "DeepCompile", _deep_compile),
    Unbuilt(("data_types",), "gradient accumulation or parameters in 16 bits", _reduced_precision_types),
    Unbuilt(
        ("communication_data_type",),
        "gradient reduction in 16 bits",
        _reduced_precision,
        'gradients are reduced in fp32 here; set it to "fp32" or remove it',
    ),
    Unbuilt(("use_data_before_expert_parallelism",), "data-parallel-first expert groups", _is_true),
    Unbuilt(("sequence_parallel_size",), "Ulysses sequence parallelism", _above_one),
    Unbuilt(("managed_gradient_accumulation",), "client-owned accumulation boundaries", _client_boundaries),
    Unbuilt(("fp16", "fp16_master_weights_and_grads"), "fp16 master weights", _is_true),
    Unbuilt(("bf16", "bf16_master_weights_and_grads"), "bf16 master weights", _is_true),
    Unbuilt(("bf16", "bf16_optimizer_states"), "bf16 optimizer states", _is_true),
    Unbuilt(("aio", "use_gds"), "GPUDirect Storage", _is_true),
    Unbuilt(("checkpoint", "writer", "type"), "the mock checkpoint writer", _mock, 'use "fast" or "python"'),
    Unbuilt(("checkpoint", "writer", "io_multiplier"), "multiplied checkpoint writes", _above_one),
    Unbuilt(("checkpoint", "writer", "data_parallel"), "checkpoint writes split over data-parallel ranks", _given),
    Unbuilt(("zero_optimization", "zero_hpz_partition_size"), "ZeRO++ hierarchical partitioning", _above_one),
    Unbuilt(("zero_optimization", "zero_quantized_weights"), "ZeRO++ quantized weights", _is_true),
    Unbuilt(("zero_optimization", "zero_quantized_nontrainable_weights"), "ZeRO++ quantized weights", _is_true),
    Unbuilt(("zero_optimization", "zero_quantized_gradients"), "ZeRO++ quantized gradients", _is_true),
    Unbuilt(("zero_optimization", "zenflow"), "ZenFlow", _given),
)


def _value_at(config: BaseModel, path: Path) -> tuple[bool, Any]:
    """Whether the user gave `path` (not a default) and its value."""
    node: Any = config
    for part in path:
        if isinstance(node, BaseModel):
            if part not in node.model_fields_set:
                return False, None
            node = getattr(node, part)
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return False, None
    return True, node


def no_effect_notes(config: BaseModel) -> list[str]:
    """One line for each key given that changes nothing here, for the log."""
    return [
        f" > ds_config {'.'.join(hint.path)}: accepted, no effect here ({hint.why})"
        for hint in HINTS
        if (given := _value_at(config, hint.path))[0] and hint.applies(given[1])
    ]


def refuse_unbuilt(config: BaseModel, source: str) -> None:
    """Stop with one sentence at the first feature the config turns on that is not built here."""
    for rule in UNBUILT:
        given, value = _value_at(config, rule.path)
        if given and rule.is_on(value):
            key = ".".join(rule.path)
            raise ConfigError(
                f"{key} in {source} turns on {rule.feature}, which this toolkit does not build; "
                f"{rule.instead or 'remove it or turn it off'}"
            )


def _alias(*names: str) -> Any:
    return Field(default=None, validation_alias=AliasChoices(*names))


class TopLevelKeys(Section):
    """DeepSpeed's top-level keys that the runtime does not model itself."""

    zero_allow_untested_optimizer: bool | None = None
    zero_force_ds_cpu_optimizer: bool | None = None
    disable_allgather: bool | None = None
    dump_state: bool | None = None
    disable_python_gc: bool | Count | None = None
    memory_breakdown: bool | None = None
    vocabulary_size: Count | None = None
    dataloader_drop_last: bool | None = None
    log_level: str | None = None
    managed_gradient_accumulation: bool | None = None
    communication_data_type: str | None = None
    seq_parallel_communication_data_type: str | None = None
    use_data_before_expert_parallelism: bool | None = None
    sequence_parallel_size: PositiveCount | None = None
    allgather_size: PositiveCount | None = None
    pipeline: Block | None = None
    timers: Block | None = None
    compile: Block | None = None
    data_types: Block | None = None
    wandb: Block | None = None
    csv_monitor: Block | None = None
    comet: Block | None = None
    hybrid_engine: Block | None = None
    torch_autocast: Block | None = None
    compression_training: Block | None = None
    elasticity: Block | None = None
    nebula: Block | None = None
    amp: Block | None = None
    quantize_training: Block | None = None
    eigenvalue: Block | None = None
    progressive_layer_drop: Block | None = None
    sparse_attention: Block | None = None
    weight_quantization: Block | None = None
    datastates_ckpt: Block | None = None
    tensor_parallel: Block | None = None
    expert_parallel: Block | None = None

    @model_validator(mode="before")
    @classmethod
    def _boolean_zero(cls, data: Any) -> Any:
        """DeepSpeed's oldest form, `"zero_optimization": true`, means stage 1 (with `allgather_size`)."""
        if isinstance(data, dict) and isinstance(data.get("zero_optimization"), bool):
            zero: dict[str, Any] = {"stage": int(data["zero_optimization"])}
            data = dict(data)
            allgather_size = data.pop("allgather_size", None)
            if zero["stage"] and allgather_size is not None:
                zero["allgather_bucket_size"] = allgather_size
            data["zero_optimization"] = zero
        return data


class ActivationCheckpointingConfig(Section):
    """DeepSpeed's `activation_checkpointing` block: how checkpointing works, not whether it is on."""

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: PositiveCount | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


class ZeroKeys(Section):
    """DeepSpeed's `zero_optimization` keys that the runtime does not model itself, and the
    legacy spellings of offloading (`cpu_offload`, `cpu_offload_param`)."""

    allgather_partitions: bool | None = None
    use_multi_rank_bucket_allreduce: bool | None = None
    compute_grad_norm: bool | None = None
    load_from_fp32_weights: bool | None = None
    elastic_checkpoint: bool | None = None
    stage3_model_persistence_threshold: Count | None = _alias(
        "stage3_model_persistence_threshold", "model_persistence_threshold"
    )
    stage3_max_reuse_distance: Count | None = _alias("stage3_max_reuse_distance", "max_reuse_distance")
    stage3_module_granularity_threshold: Count | None = _alias(
        "stage3_module_granularity_threshold", "module_granularity_threshold"
    )
    stage3_use_all_reduce_for_fetch_params: bool | None = _alias(
        "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params"
    )
    stage3_allgather_sequential: bool | None = _alias("stage3_allgather_sequential", "allgather_sequential")
    ignore_unused_parameters: bool | None = None
    legacy_stage1: bool | None = None
    round_robin_gradients: bool | None = None
    parameter_alignment: bool | None = None
    memory_efficient_linear: bool | None = None
    pipeline_loading_checkpoint: bool | None = None
    override_module_apply: bool | None = None
    log_trace_cache_warnings: bool | None = None
    enable_sanity_checks: bool | None = None
    save_muon_momentum_buffer_in_memory: bool | None = None
    leaf_module: Block | None = None
    zero_hpz_partition_size: PositiveCount | None = None
    zero_quantized_weights: bool | None = None
    zero_quantized_nontrainable_weights: bool | None = None
    zero_quantized_gradients: bool | None = None
    zenflow: Block | None = None
    cpu_offload: bool | None = None
    cpu_offload_param: bool | None = None
    cpu_offload_use_pin_memory: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _legacy_offload(cls, data: Any) -> Any:
        """`cpu_offload: true` is DeepSpeed's old spelling of offload_optimizer to the CPU, and
        `cpu_offload_param: true` of offload_param to the CPU."""
        if not isinstance(data, dict):
            return data
        for legacy, block in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
            if data.get(legacy) is True:
                if block in data:
                    raise ValueError(f"{legacy} is the old spelling of {block}; give only {block}")
                data = {**data, block: {"device": "cpu"}}
        return data


class OffloadOptimizerKeys(Section):
    ratio: float | None = None
    super_offload: bool | None = None
    cpuadam_cores_perc: float | None = None


class FP16Keys(Section):
    auto_cast: bool | None = None
    fp16_master_weights_and_grads: bool | None = None


class BF16Keys(Section):
    immediate_grad_update: bool | None = None
    check_grad_overflow: bool | None = None
    bf16_master_weights_and_grads: bool | None = None
    bf16_optimizer_states: bool | None = None


class CheckpointKeys(Section):
    tag_validation: str | None = None
    load_universal: bool | None = None
    use_node_local_storage: bool | None = None
    parallel_write: Block | None = None
    checkpoint_serialization: bool | None = None


class CheckpointWriterKeys(Section):
    show_statistics: bool | None = None
    io_multiplier: PositiveCount | None = None
    data_parallel: str | None = None


class AioKeys(Section):
    use_gds: bool | None = None


class OptimizerKeys(Section):
    legacy_fusion: bool | None = None
