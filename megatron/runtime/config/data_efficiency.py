"""DeepSpeed's `data_efficiency` block, typed: random-LTD under `data_routing.random_ltd`
(megatron/model/random_ltd.py, megatron/training/random_ltd_schedule.py). Its curriculum sampling
(`data_sampling.curriculum_learning`) is not built yet and is refused by deepspeed_keys.py; the
umbrella `enabled` keys turn nothing on by themselves, as in DeepSpeed."""

from typing import Any, Literal

from pydantic import Field

from megatron.runtime.config.schema_types import Block, Count, PositiveCount, Section


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


class DataEfficiencyConfig(Section):
    enabled: bool = False
    seed: Count = 1234  # the random-LTD token choice's seed
    data_routing: DataRoutingConfig = DataRoutingConfig()
    data_sampling: Block | None = None

    def model_post_init(self, context: Any) -> None:
        if self.data_routing.random_ltd.enabled and not (self.enabled and self.data_routing.enabled):
            raise ValueError(
                "data_routing.random_ltd.enabled is true under a data_efficiency or data_routing block with enabled "
                "false; set enabled true on both to train with random-LTD, or turn random_ltd off"
            )

    @property
    def random_ltd(self) -> RandomLTDConfig | None:
        """The random-LTD settings when it is on."""
        return self.data_routing.random_ltd if self.data_routing.random_ltd.enabled else None
