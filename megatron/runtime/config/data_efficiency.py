"""DeepSpeed's `data_efficiency` block, typed: random-LTD under `data_routing.random_ltd`
(megatron/model/random_ltd.py, megatron/training/random_ltd_schedule.py) and curriculum sampling
under `data_sampling.curriculum_learning` (megatron/data/curriculum_sampler.py,
megatron/training/curriculum.py); the umbrella `enabled` keys turn nothing on by themselves, as in
DeepSpeed."""

from typing import Any, Literal

from pydantic import Field

from megatron.runtime.config.curriculum_schedule import DifficultySchedule
from megatron.runtime.config.schema_types import Count, PositiveCount, Section

# the metric whose difficulty is the sequence length the iteration's samples are cut to, as
# Megatron-DeepSpeed's data_post_process names it
SEQLEN_TRUNCATE = "seqlen_truncate"


class RandomLTDScheduleConfig(Section):
    require_steps: PositiveCount  # steps for the kept length to grow from min_value to max_value
    seq_per_step: PositiveCount  # the kept length moves in multiples of this


class LayerTokenLRSchedule(Section):
    """DeepSpeed's LR schedule by layer tokens: work in progress there (it raises when enabled)."""

    enabled: Literal[False] = False
    total_layer_tokens: Count | None = None
    warmup_type: str | None = None


class RandomLTDSchedule(Section):
    min_value: PositiveCount
    max_value: PositiveCount
    schedule_type: Literal["fixed_linear"] = "fixed_linear"
    schedule_config: RandomLTDScheduleConfig

    def model_post_init(self, context: Any) -> None:
        if self.min_value > self.max_value:
            raise ValueError(
                f"min_value {self.min_value} is above max_value {self.max_value}; the kept length grows from min to max"
            )


class RandomLTDConfig(Section):
    enabled: bool = False
    total_layer_num: PositiveCount | None = None  # the model's layers (--num-layers), checked against it
    random_ltd_layer_num: PositiveCount | None = None
    random_ltd_layer_id: list[Count] = Field(
        default_factory=list
    )  # 0-based indices of the layers that see a share of the tokens
    model_mask_name: str = "attention_mask"  # DeepSpeed's name for the mask argument it slices
    model_type: Literal["decoder"] = "decoder"  # the GPT models here are decoders
    hidden_state_order: Literal["batch_seq_dim", "seq_batch_dim"] = "batch_seq_dim"
    random_ltd_schedule: RandomLTDSchedule | None = None
    layer_token_lr_schedule: LayerTokenLRSchedule = LayerTokenLRSchedule()
    global_batch_size: PositiveCount | None = None  # DeepSpeed's templates repeat the batch sizes here
    micro_batch_size: PositiveCount | None = None

    def model_post_init(self, context: Any) -> None:
        if not self.enabled:
            return
        if not self.random_ltd_layer_id or self.random_ltd_schedule is None:
            raise ValueError("random_ltd needs random_ltd_layer_id and random_ltd_schedule when enabled")
        if len(set(self.random_ltd_layer_id)) != len(self.random_ltd_layer_id):
            raise ValueError(f"random_ltd_layer_id {self.random_ltd_layer_id} names a layer twice")
        if self.random_ltd_layer_num is not None and self.random_ltd_layer_num != len(self.random_ltd_layer_id):
            raise ValueError(
                f"random_ltd_layer_num {self.random_ltd_layer_num} is not the {len(self.random_ltd_layer_id)} "
                "layers random_ltd_layer_id lists; make them agree"
            )


class DataRoutingConfig(Section):
    enabled: bool = False
    random_ltd: RandomLTDConfig = RandomLTDConfig()


class CurriculumMetric(DifficultySchedule):
    """One entry of `curriculum_metrics`: a schedule over a per-sample difficulty read from the
    offline index (tools/analyze_data.py or DeepSpeed's DataAnalyzer), or over the sequence length
    (`seqlen_truncate`, single_cluster)."""

    index_to_sample_path: str | None = None  # row k: the samples whose metric is row k of the next
    index_to_metric_path: str | None = None  # row k: one metric value, ascending
    difficulty_type: Literal["value", "percentile"]
    clustering_type: Literal["schedule_based", "single_cluster"]
    min_difficulty: PositiveCount
    max_difficulty: PositiveCount
    schedule_type: Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"]


class CurriculumSamplingConfig(Section):
    enabled: bool = False
    data_cluster_path: str | None = None  # DeepSpeed writes its clusters there; here they stay in memory
    curriculum_metrics: dict[str, CurriculumMetric] = Field(default_factory=dict)

    def model_post_init(self, context: Any) -> None:
        if not self.enabled:
            return
        if not self.curriculum_metrics:
            raise ValueError("curriculum_learning needs curriculum_metrics when enabled; name at least one metric")
        for name, metric in self.curriculum_metrics.items():
            metric.check_schedule(f"{name} difficulty")
            if name == "seqlen_reshape":
                raise ValueError(
                    "curriculum metric seqlen_reshape (rows re-cut to the length) is not built; use seqlen_truncate"
                )
            if metric.clustering_type == "single_cluster" and name != SEQLEN_TRUNCATE:
                raise ValueError(
                    f"curriculum metric {name} is single_cluster, which only {SEQLEN_TRUNCATE} acts on here (it cuts "
                    "the sequences); make it schedule_based with index_to_sample_path, or drop it"
                )
            if name == SEQLEN_TRUNCATE and (metric.clustering_type, metric.difficulty_type) != (
                "single_cluster",
                "value",
            ):
                raise ValueError(
                    f"curriculum metric {SEQLEN_TRUNCATE} is a sequence length: give it clustering_type single_cluster "
                    "and difficulty_type value"
                )
            if metric.clustering_type == "schedule_based":
                needed = ["index_to_sample_path"] + (
                    ["index_to_metric_path"] if metric.difficulty_type == "value" else []
                )
                missing = [key for key in needed if getattr(metric, key) is None]
                if missing:
                    raise ValueError(
                        f"curriculum metric {name} is schedule_based by {metric.difficulty_type} and needs "
                        f"{missing[0]}; write it with tools/analyze_data.py"
                    )


class DataSamplingConfig(Section):
    enabled: bool = False
    # DeepSpeed's cap on the passes over one epoch: it never binds here, the training split already
    # holding --train-iters x --global-batch-size samples (megatron/training/curriculum.py)
    num_epochs: PositiveCount = 1000
    num_workers: Count = 0  # DeepSpeed's loader workers; the loader's are --num-workers here
    curriculum_learning: CurriculumSamplingConfig = CurriculumSamplingConfig()

    def model_post_init(self, context: Any) -> None:
        if self.num_workers:
            raise ValueError(
                f"num_workers {self.num_workers}: the data loader's workers are --num-workers here; set it 0 or drop it"
            )


class DataEfficiencyConfig(Section):
    enabled: bool = False
    seed: Count = 1234  # the random-LTD token choice's and the curriculum sampling's seed
    data_routing: DataRoutingConfig = DataRoutingConfig()
    data_sampling: DataSamplingConfig = DataSamplingConfig()

    def model_post_init(self, context: Any) -> None:
        if self.data_routing.random_ltd.enabled and not (self.enabled and self.data_routing.enabled):
            raise ValueError(
                "data_routing.random_ltd.enabled is true under a data_efficiency or data_routing block with enabled "
                "false; set enabled true on both to train with random-LTD, or turn random_ltd off"
            )
        if self.data_sampling.curriculum_learning.enabled and not (self.enabled and self.data_sampling.enabled):
            raise ValueError(
                "data_sampling.curriculum_learning.enabled is true under a data_efficiency or data_sampling block "
                "with enabled false; set enabled true on both to sample by curriculum, or turn it off"
            )

    @property
    def random_ltd(self) -> RandomLTDConfig | None:
        """The random-LTD settings when it is on."""
        return self.data_routing.random_ltd if self.data_routing.random_ltd.enabled else None

    @property
    def curriculum_sampling(self) -> CurriculumSamplingConfig | None:
        """The curriculum sampling settings when it is on."""
        learning = self.data_sampling.curriculum_learning
        return learning if learning.enabled else None
