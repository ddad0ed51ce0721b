"""DeepSpeed's curriculum learning, as Megatron-DeepSpeed runs it: the iteration's sequences are
cut to a schedule's length (the tokens, labels and loss mask alike), from the legacy
`curriculum_learning` block or from data_efficiency's `seqlen_truncate` metric; data_efficiency's
other metrics choose which samples an iteration draws (megatron/data/curriculum_sampler.py).

The difficulty at step i (counted from 1, DeepSpeed's `global_steps + 1`, and its data sampler's
curriculum_step) is DeepSpeed's CurriculumScheduler's: fixed_root is
min + floor((i / total)^(1 / root) x (max - min)), less its remainder by difficulty_step, at most
max; fixed_linear is fixed_root with root 1; fixed_discrete is difficulty[k] for the first
max_step[k] >= i, the last difficulty after the last max_step. DeepSpeed stops updating once
max_difficulty is reached; a function of i alone keeps that (the first difficulty at max holds
after), so a resumed run continues the schedule exactly."""

import math
from dataclasses import dataclass

from megatron.config.flags import PretrainConfig
from megatron.data.curriculum_sampler import CurriculumSampler, MetricIndex, SampledMetric
from megatron.errors import ConfigError
from megatron.runtime.config.curriculum_schedule import DifficultySchedule
from megatron.runtime.config.data_efficiency import SEQLEN_TRUNCATE, DataEfficiencyConfig
from megatron.runtime.config.schema import CurriculumLearningConfig


class CurriculumSchedule:
    def __init__(self, config: DifficultySchedule) -> None:
        self.config = config

    def _formula(self, step: int) -> int:
        c, s = self.config, self.config.schedule_config
        if c.schedule_type == "fixed_discrete":
            return next((d for d, last in zip(s.difficulty, s.max_step) if step <= last), s.difficulty[-1])
        root = 1 if c.schedule_type == "fixed_linear" else s.root_degree
        share = (step / s.total_curriculum_step) ** (1.0 / root)
        value = math.floor(share * (c.max_difficulty - c.min_difficulty) + c.min_difficulty)
        return min(value - value % s.difficulty_step, c.max_difficulty)

    def difficulty(self, step: int) -> int:
        """The difficulty of step `step` (from 1)."""
        c = self.config
        if c.schedule_type == "fixed_discrete":  # a list may reach max and come down: max holds once reached
            reached = next((d for d, last in zip(c.schedule_config.difficulty, c.schedule_config.max_step)
                            if d >= c.max_difficulty and last < step), None)  # fmt: skip
            if reached is not None:
                return reached
        return self._formula(step)


def sequence_curriculum(
    config: CurriculumLearningConfig, efficiency: DataEfficiencyConfig, run: PretrainConfig
) -> CurriculumSchedule | None:
    """The schedule of the run's sequence lengths (None without one), once the run's layout is
    known to take it: the legacy block's, or data_efficiency's seqlen_truncate metric's."""
    t = run.training
    if not config.enabled:
        if t.curriculum_learning_legacy:
            raise ConfigError(
                "--curriculum-learning-legacy needs the ds_config curriculum_learning block with enabled true; "
                "add it to --deepspeed_config or drop the flag"
            )
        sampling = efficiency.curriculum_sampling
        if sampling is None or SEQLEN_TRUNCATE not in sampling.curriculum_metrics:
            return None
        lengths, where = sampling.curriculum_metrics[SEQLEN_TRUNCATE], f"curriculum metric {SEQLEN_TRUNCATE}"
    else:
        if efficiency.curriculum_sampling is not None:
            raise ConfigError(
                "the legacy curriculum_learning block and data_efficiency's curriculum sampling are both on; "
                f"keep one (data_efficiency's {SEQLEN_TRUNCATE} metric cuts the sequences as the legacy block does)"
            )
        lengths, where = config, "curriculum_learning"
    if lengths.max_difficulty > t.seq_length:
        raise ConfigError(
            f"{where}.max_difficulty {lengths.max_difficulty} is above --seq-length {t.seq_length}; "
            "the curriculum can only cut sequences shorter"
        )
    s = lengths.schedule_config
    steps = s.difficulty if lengths.schedule_type == "fixed_discrete" else [s.difficulty_step, lengths.max_difficulty]
    if t.sequence_parallel and any(length % t.tensor_parallel_size for length in steps):
        raise ConfigError(
            f"{where}'s lengths {steps} must split over --tensor-model-parallel-size "
            f"{t.tensor_parallel_size} under --sequence-parallel; make them multiples of it"
        )
    return CurriculumSchedule(lengths)


@dataclass(frozen=True)
class CurriculumSampling:
    """data_efficiency's curriculum sampling for a run: its schedule-based metrics with their
    indexes loaded and the seed of its draws. (data_sampling.num_epochs, DeepSpeed's cap on the
    passes over one epoch's samples, never binds here: the training split already holds the run's
    --train-iters x --global-batch-size samples, Megatron's repeated epochs included.)"""

    metrics: list[SampledMetric]
    seed: int

    def sampler(
        self, num_samples: int, run: PretrainConfig, dp_rank: int, dp_size: int, consumed_steps: int
    ) -> CurriculumSampler:
        """This rank's sampler of the training split's `num_samples`, from step `consumed_steps` + 1."""
        t = run.training
        return CurriculumSampler(
            self.metrics, num_samples, self.seed, t.global_batch_size, t.micro_batch_size, dp_rank, dp_size,
            consumed_steps,
        )  # fmt: skip


def curriculum_sampling_for(config: DataEfficiencyConfig, run: PretrainConfig) -> CurriculumSampling | None:
    """The run's curriculum sampling (None without it), its metrics' indexes read."""
    sampling = config.curriculum_sampling
    if sampling is None:
        if run.training.data_efficiency_curriculum_learning:
            raise ConfigError(
                "--data-efficiency-curriculum-learning needs the ds_config "
                "data_efficiency.data_sampling.curriculum_learning block with enabled true; add it to "
                "--deepspeed_config or drop the flag"
            )
        return None
    metrics = [
        SampledMetric(
            name,
            CurriculumSchedule(metric).difficulty,
            metric.difficulty_type == "percentile",
            metric.max_difficulty,
            MetricIndex.load(
                metric.index_to_sample_path, metric.index_to_metric_path if metric.difficulty_type == "value" else None
            ),
        )
        for name, metric in sampling.curriculum_metrics.items()
        if metric.clustering_type == "schedule_based"
    ]
    return CurriculumSampling(metrics, config.seed)
