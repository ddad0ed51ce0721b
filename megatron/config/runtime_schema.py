"""Runtime config in DeepSpeed's JSON schema (the keys supported so far), validated by pydantic.

Unknown keys are errors that suggest the nearest known key; the three batch sizes are resolved
against the data-parallel size (any two give the third).
"""

import difflib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from megatron.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class OptimizerConfig(_Section):
    type: Literal["Adam", "AdamW", "Lamb"] = "AdamW"
    params: dict[str, Any] = {}


class FP16Config(_Section):
    enabled: bool = False
    loss_scale: float = 0.0  # 0 means dynamic
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0


class BF16Config(_Section):
    enabled: bool = False


class SchedulerConfig(_Section):
    type: str
    params: dict[str, Any] = {}


class OffloadOptimizerConfig(_Section):
    """`offload_optimizer`: where the fp32 optimizer state lives. "cpu": host memory, stepped by
    the native CPU Adam; "nvme": Adam's moments in swap files under nvme_path, moved by the
    async-I/O op through `buffer_count` locked buffers (pipelined with pipeline_read/write)."""
    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    pin_memory: bool = False  # host buffers here are always the aio op's locked ones
    buffer_count: int = 4
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False  # skip writing zeros to the swap files at start-up


class OffloadParamConfig(_Section):
    """`offload_param` (stage 3): where the parameter partitions (here: the fp32 master shards they
    are gathered from) live. "cpu": host memory, where CPU training keeps them anyway; "nvme":
    swap files under nvme_path, except the first `max_in_cpu` elements of each rank, read ahead of
    use through `buffer_count` locked buffers of up to `buffer_size` elements."""
    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    pin_memory: bool = False  # host buffers here are always the aio op's locked ones
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000

    def model_post_init(self, context: Any) -> None:
        for key in ("buffer_count", "buffer_size"):
            if getattr(self, key) <= 0:
                raise ValueError(f"offload_param.{key} must be positive, got {getattr(self, key)}")
        if self.max_in_cpu < 0:
            raise ValueError(f"offload_param.max_in_cpu must be zero or a positive number of elements, got {self.max_in_cpu}")


class ZeroConfig(_Section):
    """DeepSpeed's `zero_optimization` block. Sizes count elements, as in DeepSpeed."""
    stage: Literal[0, 1, 2, 3] = 0
    # gradients are always views of one flat buffer here, so they are contiguous either way
    contiguous_gradients: bool = True
    reduce_scatter: bool = True  # False: all-reduce each bucket instead
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool | None = None  # None: DeepSpeed's default, on for stage 3 only
    sub_group_size: int = 1_000_000_000  # the unit of optimizer swapping (offload)
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    offload_optimizer: OffloadOptimizerConfig = OffloadOptimizerConfig()
    offload_param: OffloadParamConfig = OffloadParamConfig()

    def model_post_init(self, context: Any) -> None:
        sizes = ("reduce_bucket_size", "allgather_bucket_size", "sub_group_size", "stage3_max_live_parameters")
        for key in sizes:
            if getattr(self, key) <= 0:
                raise ValueError(f"{key} must be a positive number of elements, got {getattr(self, key)}")
        for key in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be zero or a positive number of elements, got {getattr(self, key)}")
        if self.offload_optimizer.device != "none" and self.stage == 0:
            raise ValueError("offload_optimizer needs ZeRO (stage 1, 2 or 3) to partition the state it moves; "
                             "set zero_optimization.stage")
        if self.offload_param.device != "none" and self.stage != 3:
            raise ValueError(f"offload_param needs zero_optimization.stage 3 (only stage 3 partitions parameters), "
                             f"got stage {self.stage}; set stage 3 or drop offload_param")
        if self.offload_param.device == "nvme" and self.offload_optimizer.device != "nvme":
            raise ValueError("offload_param to nvme needs offload_optimizer.device \"nvme\" too: the optimizer steps "
                             "the swapped master piece by piece through the swap files; set offload_optimizer.device")

    @property
    def overlaps_communication(self) -> bool:
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm

    @property
    def bucket_numel(self) -> int:
        """Elements per gradient bucket of stages 1 and 2: the same buckets are reduced and, after
        the step, gathered in place, so both size limits apply to them."""
        return min(self.reduce_bucket_size, self.allgather_bucket_size)


class AioConfig(_Section):
    """The async-I/O handle settings for NVMe swapping (DeepNVMe's names and defaults)."""
    block_size: int = 1_048_576
    queue_depth: int = 8
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = True

    def model_post_init(self, context: Any) -> None:
        for key in ("block_size", "queue_depth", "intra_op_parallelism"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key} must be positive, got {getattr(self, key)}")


class TensorBoardConfig(_Section):
    """The engine's own scalars (loss, learning rate, loss scale by samples), DeepSpeed's layout."""
    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class RuntimeConfig(_Section):
    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int | None = None
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroConfig = ZeroConfig()
    fp16: FP16Config = FP16Config()
    bf16: BF16Config = BF16Config()
    gradient_clipping: float = 0.0
    steps_per_print: int = 10  # the engine's own progress line every N steps; 0: none
    wall_clock_breakdown: bool = False  # forward / backward / step times on that line
    tensorboard: TensorBoardConfig = TensorBoardConfig()
    aio: AioConfig = AioConfig()


def _explain(error: ValidationError, source: str) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    if first["type"] == "extra_forbidden":
        section: type[BaseModel] = RuntimeConfig
        for part in first["loc"][:-1]:
            section = section.model_fields[str(part)].annotation
        close = difflib.get_close_matches(str(first["loc"][-1]), section.model_fields, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else "; remove it"
        return f"unknown key {where!r} in {source}{hint}"
    return f"bad value for {where!r} in {source}: {first['msg'].removeprefix('Value error, ')}"


def read_config_file(path: str | Path) -> dict[str, Any]:
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read the runtime config {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"the runtime config {path} must hold a JSON object")
    return config


def validate_runtime_config(config: dict[str, Any], source: str = "the runtime config") -> RuntimeConfig:
    """Check a DeepSpeed-style config's keys and values (batch sizes not yet resolved)."""
    try:
        return RuntimeConfig.model_validate(config)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, source)) from None


def load_runtime_config(config: dict[str, Any] | str | Path, dp_size: int) -> RuntimeConfig:
    """Validate a DeepSpeed-style config (a dict or a JSON file) and resolve its batch sizes."""
    if isinstance(config, dict):
        return resolve_batch_sizes(validate_runtime_config(config), dp_size)
    return resolve_batch_sizes(validate_runtime_config(read_config_file(config), str(config)), dp_size)


def resolve_batch_sizes(config: RuntimeConfig, dp_size: int) -> RuntimeConfig:
    """train_batch_size = micro batch x accumulation steps x data-parallel size."""
    train, micro, accum = (
        config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps
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
    return config.model_copy(update={
        "train_batch_size": train, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
    })
