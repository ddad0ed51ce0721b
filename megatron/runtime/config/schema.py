"""Runtime config in DeepSpeed's JSON schema (the keys supported so far), validated by pydantic.

Strict types (`"false"` is not a boolean, `"1e-3"` is not a number), finite numbers and each
value's range are checked here, and unknown keys at every level are errors that suggest the
nearest known key; the three batch sizes are resolved against the data-parallel size (any two
give the third).
"""

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import AliasChoices, BaseModel, BeforeValidator, Field, ValidationError

from megatron.comm.comms_log import check_op_names
from megatron.errors import ConfigError
from megatron.runtime.config.checkpoint_writer import CheckpointConfig
from megatron.runtime.config.combinations import refuse_contradictions
from megatron.runtime.config.config_file import read_config_source
from megatron.runtime.config.curriculum_schedule import DifficultySchedule
from megatron.runtime.config.data_efficiency import DataEfficiencyConfig
from megatron.runtime.config.deepspeed_keys import (
    ActivationCheckpointingConfig,
    AioKeys,
    BF16Keys,
    FP16Keys,
    OffloadOptimizerKeys,
    OptimizerKeys,
    TopLevelKeys,
    ZeroKeys,
    refuse_unbuilt,
)
from megatron.runtime.config.folders import blocking_file
from megatron.runtime.config.schema_types import (
    Beta,
    Count,
    LossScale,
    NonNegative,
    Positive,
    PositiveCount,
    ScalePower,
    Section,
    StaticLossScale,
    ZeroStage,
)

# the parameters each optimizer type takes, as DeepSpeed's classes do
_COMMON = ("lr", "betas", "eps", "weight_decay", "bias_correction", "max_grad_norm")
_ADAM = (*_COMMON, "adam_w_mode", "amsgrad")
_LAMB = (*_COMMON, "max_coeff", "min_coeff")
_TRANSPORT = ("cuda_aware", "comm_backend_name")
PARAMETERS_OF = {
    "Adam": _ADAM,
    "AdamW": _ADAM,
    "Lamb": _LAMB,
    "OneBitAdam": (*_COMMON, "freeze_step", *_TRANSPORT),
    "ZeroOneAdam": (
        *_COMMON, "var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper", *_TRANSPORT
    ),
    "OneBitLamb": (
        *_LAMB, "freeze_step", "coeff_beta", "factor_max", "factor_min", "factor_threshold", *_TRANSPORT
    ),
}  # fmt: skip


class OptimizerParams(Section):
    """DeepSpeed's Adam/AdamW and Lamb parameters; only those given reach the optimizer, which
    supplies its own defaults (DeepSpeed's) for the rest."""

    lr: NonNegative = 1e-3
    betas: Annotated[tuple[Beta, Beta], BeforeValidator(lambda v: tuple(v) if isinstance(v, list) else v)] = (
        0.9,
        0.999,
    )
    eps: Positive = 1e-8
    weight_decay: NonNegative = 0.0
    bias_correction: bool = True
    adam_w_mode: bool = True
    amsgrad: bool = False
    max_coeff: Positive = 10.0
    min_coeff: NonNegative = 0.01
    max_grad_norm: NonNegative | None = None  # refused below, with the key to use
    freeze_step: Count = 100000  # OneBitAdam, OneBitLamb: uncompressed warm-up steps
    cuda_aware: bool = False  # the 1-bit optimizers: DeepSpeed's transport choices, torch.distributed's here
    comm_backend_name: str = "nccl"
    var_freeze_step: Count = 100000  # ZeroOneAdam: the last step that may update the variance
    var_update_scaler: PositiveCount = 16  # ZeroOneAdam: variance updates before their interval doubles
    local_step_scaler: PositiveCount = 32678  # ZeroOneAdam: local steps before their interval doubles
    local_step_clipper: PositiveCount = 16  # ZeroOneAdam: the longest interval between synchronisations
    coeff_beta: Beta = 0.9  # OneBitLamb: running average of the warm-up's LAMB coefficients
    factor_max: Positive = 4.0  # OneBitLamb: bounds of the frozen coefficient's scaling factor
    factor_min: NonNegative = 0.5
    factor_threshold: NonNegative = 0.1  # OneBitLamb: how far the factor may move in one step

    def model_post_init(self, context: Any) -> None:
        if "max_grad_norm" in self.model_fields_set:  # DeepSpeed's engine refuses it the same way
            raise ValueError(
                "max_grad_norm is not an optimizer parameter; clip with the top-level gradient_clipping key instead"
            )

    def given(self) -> dict[str, Any]:
        return self.model_dump(include=self.model_fields_set)


OPTIMIZERS = tuple(PARAMETERS_OF)


def _optimizer_name(name: Any) -> Any:
    """DeepSpeed reads its optimizer names in any case ("adamw", "ADAM")."""
    if isinstance(name, str):
        return next((known for known in OPTIMIZERS if known.lower() == name.lower()), name)
    return name


class OptimizerConfig(OptimizerKeys):
    type: Annotated[Literal[OPTIMIZERS], BeforeValidator(_optimizer_name)] = "AdamW"
    params: OptimizerParams = OptimizerParams()

    def model_post_init(self, context: Any) -> None:
        wrong = sorted(self.params.model_fields_set - set(PARAMETERS_OF[self.type]))
        if wrong:
            raise ValueError(f"{wrong[0]} is not a parameter of {self.type}; remove it or change optimizer.type")


class FP16Config(FP16Keys):
    enabled: bool = False
    loss_scale: StaticLossScale = 0.0  # 0 means dynamic
    initial_scale_power: ScalePower = 16
    loss_scale_window: PositiveCount = 1000
    hysteresis: PositiveCount = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: LossScale = 1.0

    def model_post_init(self, context: Any) -> None:
        if self.enabled and self.loss_scale == 0 and self.min_loss_scale > 2.0**self.initial_scale_power:
            raise ValueError(
                f"min_loss_scale {self.min_loss_scale!r} is above the initial scale 2**{self.initial_scale_power}, "
                "so the dynamic scale would start below its minimum; lower min_loss_scale or raise initial_scale_power"
            )


class BF16Config(BF16Keys):
    enabled: bool = False


class SchedulerConfig(Section):
    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class OffloadOptimizerConfig(OffloadOptimizerKeys):
    """`offload_optimizer`: where the fp32 optimizer state lives. "cpu": host memory, stepped by
    the native CPU Adam; "nvme": Adam's moments in swap files under nvme_path, moved by the
    async-I/O op through `buffer_count` locked buffers (pipelined with pipeline_read/write)."""

    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    pin_memory: bool = False  # host buffers here are always the aio op's locked ones
    buffer_count: PositiveCount = 4
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False  # skip writing zeros to the swap files at start-up


class OffloadParamConfig(Section):
    """`offload_param` (stage 3): where the parameter partitions (here: the fp32 master shards they
    are gathered from) live. "cpu": host memory, where CPU training keeps them anyway; "nvme":
    swap files under nvme_path, except the first `max_in_cpu` elements of each rank, read ahead of
    use through `buffer_count` locked buffers of up to `buffer_size` elements."""

    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    pin_memory: bool = False  # host buffers here are always the aio op's locked ones
    buffer_count: PositiveCount = 5
    buffer_size: PositiveCount = 100_000_000
    max_in_cpu: Count = 1_000_000_000


class ZeroConfig(ZeroKeys):
    """DeepSpeed's `zero_optimization` block. Sizes count elements, as in DeepSpeed."""

    stage: ZeroStage = 0
    # gradients are always views of one flat buffer here, so they are contiguous either way
    contiguous_gradients: bool = True
    reduce_scatter: bool = True  # False: all-reduce each bucket instead
    reduce_bucket_size: PositiveCount = 500_000_000
    allgather_bucket_size: PositiveCount = 500_000_000
    overlap_comm: bool | None = None  # None: DeepSpeed's default, on for stage 3 only
    sub_group_size: PositiveCount = 1_000_000_000  # the unit of optimizer swapping (offload)
    # DeepSpeed reads these with or without the stage3_ prefix
    stage3_prefetch_bucket_size: Count = Field(
        50_000_000, validation_alias=AliasChoices("stage3_prefetch_bucket_size", "prefetch_bucket_size")
    )
    stage3_param_persistence_threshold: Count = Field(
        100_000, validation_alias=AliasChoices("stage3_param_persistence_threshold", "param_persistence_threshold")
    )
    stage3_max_live_parameters: PositiveCount = Field(
        1_000_000_000, validation_alias=AliasChoices("stage3_max_live_parameters", "max_live_parameters")
    )
    # Engine.save_16bit_model under stage 3 gathers the partitions only when asked to
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        False,
        validation_alias=AliasChoices(
            "stage3_gather_16bit_weights_on_model_save",
            "gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
        ),
    )
    offload_optimizer: OffloadOptimizerConfig = OffloadOptimizerConfig()
    offload_param: OffloadParamConfig = OffloadParamConfig()

    def model_post_init(self, context: Any) -> None:
        if self.offload_optimizer.device != "none" and self.stage == 0:
            raise ValueError(
                "offload_optimizer needs ZeRO (stage 1, 2 or 3) to partition the state it moves; "
                "set zero_optimization.stage"
            )
        if self.offload_param.device != "none" and self.stage != 3:
            raise ValueError(
                f"offload_param needs zero_optimization.stage 3 (only stage 3 partitions parameters), "
                f"got stage {self.stage}; set stage 3 or drop offload_param"
            )
        if self.offload_param.device == "nvme" and self.offload_optimizer.device != "nvme":
            raise ValueError(
                'offload_param to nvme needs offload_optimizer.device "nvme" too: the optimizer steps '
                "the swapped master piece by piece through the swap files; set offload_optimizer.device"
            )

    @property
    def overlaps_communication(self) -> bool:
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm

    @property
    def bucket_numel(self) -> int:
        """Elements per gradient bucket of stages 1 and 2: the same buckets are reduced and, after
        the step, gathered in place, so both size limits apply to them."""
        return min(self.reduce_bucket_size, self.allgather_bucket_size)


class AioConfig(AioKeys):
    """The async-I/O handle settings for NVMe swapping (DeepNVMe's names and defaults)."""

    block_size: PositiveCount = 1_048_576
    queue_depth: PositiveCount = 8
    intra_op_parallelism: PositiveCount = 1
    single_submit: bool = False
    overlap_events: bool = True

    def handle_settings(self) -> dict[str, Any]:
        """The aio_handle constructor's arguments."""
        return self.model_dump(exclude=set(AioKeys.model_fields))


class TensorBoardConfig(Section):
    """The engine's own scalars (loss, learning rate, loss scale by samples), DeepSpeed's layout."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"

    def model_post_init(self, context: Any) -> None:
        folder = Path(self.output_path or "runs") / self.job_name  # where the engine's monitor writes
        in_the_way = blocking_file(folder) if self.enabled else None
        if in_the_way is not None:
            raise ValueError(
                f"{in_the_way} is a file, so the TensorBoard logs cannot go to {folder}; point output_path and "
                "job_name at a folder, or at a path that does not exist yet"
            )


class FlopsProfilerConfig(Section):
    """DeepSpeed's `flops_profiler` block: the forwards of training step `profile_step` (counted from
    0, as DeepSpeed's global_steps) profiled, and the profile printed once that step is taken."""

    enabled: bool = False
    recompute_fwd_factor: NonNegative = 0.0
    profile_step: Count = 1
    module_depth: int = -1  # -1: every depth
    top_modules: PositiveCount = 1
    detailed: bool = True
    output_file: str | None = None  # None: stdout

    def model_post_init(self, context: Any) -> None:
        if self.module_depth < -1:
            raise ValueError(f"module_depth {self.module_depth} is below -1; give -1 (every depth) or a depth")


class CommsLoggerConfig(Section):
    """DeepSpeed's `comms_logger` block (megatron/comm/comms_log.py): every op, or those named in
    `prof_ops` when `prof_all` is off; `verbose` prints each op; `debug` adds its caller's name."""

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    prof_ops: list[str] = Field(default_factory=list)
    debug: bool = False

    def model_post_init(self, context: Any) -> None:
        check_op_names(self.prof_ops)


class CurriculumLearningConfig(DifficultySchedule):
    """DeepSpeed's legacy `curriculum_learning` block: the sequence length grows from
    min_difficulty to max_difficulty on the schedule (megatron/training/curriculum.py)."""

    enabled: bool = False
    curriculum_type: Literal["seqlen"] = "seqlen"

    def model_post_init(self, context: Any) -> None:
        if self.enabled:
            self.check_schedule("sequences")


class AutotuningConfig(Section):
    """DeepSpeed's `autotuning` block, read by the autotuner (tools/autotune.py --autotuning tune|run,
    megatron/autotuning/); a training run itself ignores it. DeepSpeed's keys and defaults; its
    model-based tuner is not built (gridsearch and random are); `mp_size` must be the flags' TP x PP."""

    enabled: bool = False
    metric: Literal["throughput", "latency", "flops"] = "throughput"
    start_profile_step: PositiveCount = 3  # the iterations after this one, up to end_profile_step, are measured
    end_profile_step: PositiveCount = 5
    fast: bool = True  # activation checkpointing and offload tried only where a setting without them cannot fit
    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    tuner_num_trials: PositiveCount = 50
    tuner_early_stopping: PositiveCount = 5  # trials in a row without a better one, then stop
    max_train_batch_size: PositiveCount | None = None
    mp_size: PositiveCount = 1
    min_train_micro_batch_size_per_gpu: PositiveCount = 1
    max_train_micro_batch_size_per_gpu: PositiveCount = 1024
    num_tuning_micro_batch_sizes: PositiveCount = 3
    results_dir: str = "autotuning_results"
    exps_dir: str = "autotuning_exps"
    overwrite: bool = True  # False: a trial whose result is in exps_dir is not run again
    arg_mappings: dict[str, str] | None = None  # DeepSpeed's ds_config -> script flag table: known here

    def model_post_init(self, context: Any) -> None:
        if self.tuner_type == "model_based":
            raise ValueError(
                "tuner_type model_based (DeepSpeed's XGBoost cost model) is not built here; use gridsearch or random"
            )
        if self.end_profile_step <= self.start_profile_step:
            raise ValueError(
                f"end_profile_step {self.end_profile_step} is not after start_profile_step "
                f"{self.start_profile_step}; the iterations between them are the ones measured"
            )
        if self.max_train_micro_batch_size_per_gpu < self.min_train_micro_batch_size_per_gpu:
            raise ValueError("max_train_micro_batch_size_per_gpu is below min_train_micro_batch_size_per_gpu")


class RuntimeConfig(TopLevelKeys):
    train_batch_size: PositiveCount | None = None
    train_micro_batch_size_per_gpu: PositiveCount | None = None
    gradient_accumulation_steps: PositiveCount | None = None
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroConfig = ZeroConfig()
    fp16: FP16Config = FP16Config()
    bf16: BF16Config = Field(BF16Config(), validation_alias=AliasChoices("bf16", "bfloat16"))
    gradient_clipping: NonNegative = 0.0  # 0: no clipping
    # DeepSpeed's gradient averaging over data-parallel ranks: "sum" leaves the sum; with "mean",
    # gradients are divided by the predivide factor before the all-reduce and by dp/factor after,
    # or (prescale_gradients) by the data-parallel size before it
    gradient_allreduce_op: Annotated[
        Literal["mean", "sum"], BeforeValidator(lambda op: op.lower() if isinstance(op, str) else op)
    ] = "mean"
    prescale_gradients: bool = False
    gradient_predivide_factor: Positive = 1.0
    activation_checkpointing: ActivationCheckpointingConfig = ActivationCheckpointingConfig()
    steps_per_print: Count = 10  # the engine's own progress line every N steps; 0: none
    wall_clock_breakdown: bool = False  # forward / backward / step times on that line
    tensorboard: TensorBoardConfig = TensorBoardConfig()
    aio: AioConfig = AioConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    flops_profiler: FlopsProfilerConfig = FlopsProfilerConfig()
    comms_logger: CommsLoggerConfig = CommsLoggerConfig()
    autotuning: AutotuningConfig = AutotuningConfig()
    curriculum_learning: CurriculumLearningConfig = CurriculumLearningConfig()
    data_efficiency: DataEfficiencyConfig = DataEfficiencyConfig()

    @property
    def precision(self) -> str:
        """ "fp16", "bf16" or "fp32": the dtype the forward runs in."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"


def _key_names(section: type[BaseModel]) -> dict[str, str]:
    """Every key a section accepts (field names and DeepSpeed's other spellings) -> its field."""
    names = {name: name for name in section.model_fields}
    for name, field in section.model_fields.items():
        if isinstance(field.validation_alias, AliasChoices):
            names.update((str(choice), name) for choice in field.validation_alias.choices)
    return names


def _section_at(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The config section that a location inside the JSON points into (None where it leaves them)."""
    section: type[BaseModel] = RuntimeConfig
    for part in loc:
        field = section.model_fields.get(_key_names(section).get(str(part), ""))
        if field is None:
            return None
        inner = [
            kind
            for kind in get_args(field.annotation) or (field.annotation,)
            if isinstance(kind, type) and issubclass(kind, BaseModel)
        ]
        if not inner:
            return None
        section = inner[0]
    return section


@dataclass(frozen=True)
class ConfigProblem:
    """The first problem pydantic found: where, why, and the sentence for the user."""

    loc: tuple[int | str, ...]
    value: Any
    reason: str
    sentence: str


def _unquoted(text: str) -> tuple[Any, str] | None:
    """The number or boolean that a quoted value spells, and how to write it ("true", "2", "5e8")."""
    word = text.strip()
    if word.lower() in ("true", "false"):
        return word.lower() == "true", word.lower()
    try:
        value = json.loads(word)
    except ValueError:
        return None
    return (value, word) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _replaced(config: Any, loc: tuple[int | str, ...], value: Any) -> tuple[Any, Any, int]:
    """A copy of `config` with `value` at `loc`, the value it replaced, and how many parts of `loc`
    lie in the config (pydantic's locations end with the union member tried, for some keys)."""
    if loc and isinstance(config, dict) and loc[0] in config:
        key, rest = loc[0], loc[1:]
        inner, old, depth = _replaced(config[key], rest, value)
        return {**config, key: inner}, old, depth + 1
    if loc and isinstance(config, list) and isinstance(loc[0], int) and loc[0] < len(config):
        index, rest = loc[0], loc[1:]
        inner, old, depth = _replaced(config[index], rest, value)
        return [*config[:index], inner, *config[index + 1 :]], old, depth + 1
    return value, config, 0


def _quoted_by_mistake(config: dict[str, Any], loc: tuple[int | str, ...], text: str) -> tuple[str, str] | None:
    """The key and the value to write, where the string `text` at `loc` is refused but the number
    or boolean it spells would be accepted (None otherwise)."""
    unquoted = _unquoted(text)
    if unquoted is None:
        return None
    fixed, old, depth = _replaced(config, loc, unquoted[0])
    if depth == 0 or old != text:  # the location is not in the config as written
        return None
    try:
        RuntimeConfig.model_validate(fixed)
    except ValidationError as still:
        if any(problem["loc"][:depth] == loc[:depth] for problem in still.errors()):
            return None
    return ".".join(str(part) for part in loc[:depth]), unquoted[1]


def _as_written(value: Any) -> str:
    """A value to quote in a sentence: true, false and null as the JSON spells them, a number or a
    string as Python does; nothing for a block."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    return repr(value) if isinstance(value, (str, int, float)) else ""


def explain(error: ValidationError, source: str, config: dict[str, Any]) -> ConfigProblem:
    """One sentence about the first problem in `config`, with the nearest key for a typo (unknown
    keys come first: a misspelled required key is also reported missing) and the value to write
    for a number or boolean written as a string."""
    # an unknown key first, then a bad value, then a missing key (a key given alone in a block with
    # required siblings is named for its own value)
    first = sorted(
        error.errors(), key=lambda problem: (problem["type"] != "extra_forbidden", problem["type"] == "missing")
    )[0]
    loc = first["loc"]
    where = ".".join(str(part) for part in loc)
    if first["type"] == "extra_forbidden":
        section = _section_at(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), _key_names(section) if section else [], n=1)
        hint = f"did you mean {close[0]!r}?" if close else "remove it"
        return ConfigProblem(loc, None, hint, f"unknown key {where!r} in {source}; {hint}")
    if first["type"] == "missing":
        return ConfigProblem(loc, None, "missing", f"missing key {where!r} in {source}; add it")
    message = first["msg"].removeprefix("Value error, ")
    reason = message[0].lower() + message[1:]
    value = first.get("input")
    quoted = _quoted_by_mistake(config, loc, value) if isinstance(value, str) else None
    if quoted is not None:
        key, written = quoted
        fix = f"write it without quotes: {written}"
        string = json.dumps(value)
        return ConfigProblem(
            loc, value, f"it is the string {string}; {fix}", f"{key!r} is the string {string} in {source}; {fix}"
        )
    shown = _as_written(value)
    given = f" {shown}" if shown else ""
    return ConfigProblem(loc, value, reason, f"bad value{given} for {where!r} in {source}: {reason}")


def validate_runtime_config(config: dict[str, Any], source: str = "the runtime config") -> RuntimeConfig:
    """Check a DeepSpeed-style config's keys and values (batch sizes not yet resolved)."""
    try:
        validated = RuntimeConfig.model_validate(config)
    except ValidationError as exc:
        raise ConfigError(explain(exc, source, config).sentence) from None
    refuse_unbuilt(validated, source)
    refuse_contradictions(validated)
    return validated


def load_runtime_config(config: dict[str, Any] | str | Path, dp_size: int) -> RuntimeConfig:
    """Validate a DeepSpeed-style config (a dict or a JSON file) and resolve its batch sizes."""
    if isinstance(config, dict):
        return resolve_batch_sizes(validate_runtime_config(config), dp_size)
    config, source = read_config_source(config)
    return resolve_batch_sizes(validate_runtime_config(config, source), dp_size)


def resolve_batch_sizes(config: RuntimeConfig, dp_size: int) -> RuntimeConfig:
    """train_batch_size = micro batch x accumulation steps x data-parallel size."""
    train, micro, accum = (
        config.train_batch_size,
        config.train_micro_batch_size_per_gpu,
        config.gradient_accumulation_steps,
    )
    if micro is None and accum is None:
        accum = 1
    if train is None:
        if micro is None:
            raise ConfigError("set train_micro_batch_size_per_gpu or train_batch_size in the runtime config")
        train = micro * (accum or 1) * dp_size
    if micro is None:
        micro = train // (accum * dp_size)
    if accum is None:
        accum = train // (micro * dp_size)
    if micro <= 0 or accum <= 0 or train != micro * accum * dp_size:
        raise ConfigError(
            f"train_batch_size {train} is not train_micro_batch_size_per_gpu {micro} x "
            f"gradient_accumulation_steps {accum} x data-parallel size {dp_size}; "
            "make the global batch a multiple of micro batch x data-parallel size"
        )
    return config.model_copy(
        update={
            "train_batch_size": train,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accum,
        }
    )
