"""Random-LTD's kept length per iteration, as DeepSpeed's RandomLTDScheduler computes it
(fixed_linear): from min_value, floor(t / require_steps x (max - min) + min), less its remainder by
seq_per_step, at most max_value, where t is the engine's global step after the previous update:
iteration 1 keeps min_value, iteration i > 1 the formula at t = i - 1. A function of the iteration
alone, so a resumed run continues it exactly. Under sequence parallelism the length is rounded
down to a multiple of the tensor-parallel size (the kept tokens are shared out over its ranks)."""

import math

from megatron.config.flags import PretrainConfig
from megatron.errors import ConfigError
from megatron.model.random_ltd import RandomLTD
from megatron.runtime.config.data_efficiency import DataEfficiencyConfig, RandomLTDConfig


class RandomLTDSchedule:
    def __init__(self, config: RandomLTDConfig, layers: RandomLTD, multiple: int = 1) -> None:
        assert config.random_ltd_schedule is not None, "an enabled random_ltd has its schedule (checked when read)"
        self.schedule = config.random_ltd_schedule
        self.layers = layers  # the model's, told each iteration's kept length
        self.multiple = multiple

    def begin_iteration(self, iteration: int) -> None:
        self.layers.begin_iteration(iteration, self.kept_length(iteration))

    def _formula(self, step: int) -> int:
        s, c = self.schedule, self.schedule.schedule_config
        length = math.floor(step / c.require_steps * (s.max_value - s.min_value) + s.min_value)
        return min(length - length % c.seq_per_step, s.max_value)

    def kept_length(self, iteration: int) -> int:
        """The tokens each random-LTD layer keeps of each sequence at iteration `iteration` (from 1)."""
        length = self.schedule.min_value if iteration <= 1 else self._formula(iteration - 1)
        return length - length % self.multiple


def random_ltd_for(config: DataEfficiencyConfig, run: PretrainConfig) -> RandomLTDSchedule | None:
    """The run's random-LTD and its schedule (None without it), once the run's model takes it."""
    ltd, m, t = config.random_ltd, run.model, run.training
    if ltd is None:
        if t.random_ltd:
            raise ConfigError(
                "--random-ltd needs the ds_config data_efficiency.data_routing.random_ltd block with enabled true; "
                "add it to --deepspeed_config or drop the flag"
            )
        return None
    if ltd.total_layer_num is not None and ltd.total_layer_num != m.num_layers:
        raise ConfigError(
            f"random_ltd.total_layer_num {ltd.total_layer_num} is not --num-layers {m.num_layers}; make them agree"
        )
    outside = [layer for layer in ltd.random_ltd_layer_id if layer >= m.num_layers]
    if outside:
        raise ConfigError(
            f"random_ltd.random_ltd_layer_id {outside[0]} is not a layer of this {m.num_layers}-layer model "
            f"(they count from 0); use ids below {m.num_layers}"
        )
    assert ltd.random_ltd_schedule is not None
    if ltd.random_ltd_schedule.max_value > t.seq_length:
        raise ConfigError(
            f"random_ltd_schedule.max_value {ltd.random_ltd_schedule.max_value} is above --seq-length "
            f"{t.seq_length}; a layer can keep at most the whole sequence"
        )
    multiple = t.tensor_parallel_size if t.sequence_parallel else 1
    return RandomLTDSchedule(ltd, RandomLTD(frozenset(ltd.random_ltd_layer_id), config.seed), multiple)
