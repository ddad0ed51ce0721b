"""DeepSpeed's legacy curriculum learning by sequence length, as Megatron-DeepSpeed runs it: the
iteration's sequences are cut to the schedule's length (the tokens, labels and loss mask alike).

The length at iteration i (counted from 1, DeepSpeed's `global_steps + 1`) is DeepSpeed's
CurriculumScheduler's: fixed_root is min + floor((i / total)^(1 / root) x (max - min)), less its
remainder by difficulty_step, at most max; fixed_linear is fixed_root with root 1; fixed_discrete
is difficulty[k] for the first max_step[k] >= i, the last difficulty after the last max_step.
DeepSpeed stops updating once max_difficulty is reached; a function of i alone keeps that (the
first length at max holds after), so a resumed run continues the schedule exactly."""

import math

from megatron.config.flags import PretrainConfig
from megatron.errors import ConfigError
from megatron.runtime.config.schema import CurriculumLearningConfig


class SequenceCurriculum:
    def __init__(self, config: CurriculumLearningConfig) -> None:
        self.config = config

    def _formula(self, iteration: int) -> int:
        c, s = self.config, self.config.schedule_config
        if c.schedule_type == "fixed_discrete":
            return next((d for d, last in zip(s.difficulty, s.max_step) if iteration <= last), s.difficulty[-1])
        root = 1 if c.schedule_type == "fixed_linear" else s.root_degree
        share = (iteration / s.total_curriculum_step) ** (1.0 / root)
        length = math.floor(share * (c.max_difficulty - c.min_difficulty) + c.min_difficulty)
        return min(length - length % s.difficulty_step, c.max_difficulty)

    def seq_length(self, iteration: int) -> int:
        """The sequence length of iteration `iteration` (from 1)."""
        c = self.config
        if c.schedule_type == "fixed_discrete":  # a list may reach max and come down: max holds once reached
            reached = next((d for d, last in zip(c.schedule_config.difficulty, c.schedule_config.max_step)
                            if d >= c.max_difficulty and last < iteration), None)  # fmt: skip
            if reached is not None:
                return reached
        return self._formula(iteration)


def sequence_curriculum(config: CurriculumLearningConfig, run: PretrainConfig) -> SequenceCurriculum | None:
    """The run's curriculum (None without one), once the run's layout is known to take it."""
    t = run.training
    if not config.enabled:
        if t.curriculum_learning_legacy:
            raise ConfigError(
                "--curriculum-learning-legacy needs the ds_config curriculum_learning block with enabled true; "
                "add it to --deepspeed_config or drop the flag"
            )
        return None
    if t.pipeline_parallel_size > 1:
        raise ConfigError(
            "curriculum_learning is not built under pipeline parallelism yet (the stages exchange whole "
            "sequences); train it with --pipeline-model-parallel-size 1"
        )
    if config.max_difficulty > t.seq_length:
        raise ConfigError(
            f"curriculum_learning.max_difficulty {config.max_difficulty} is above --seq-length {t.seq_length}; "
            "the curriculum can only cut sequences shorter"
        )
    curriculum = SequenceCurriculum(config)
    s = config.schedule_config
    lengths = s.difficulty if config.schedule_type == "fixed_discrete" else [s.difficulty_step, config.max_difficulty]
    if t.sequence_parallel and any(length % t.tensor_parallel_size for length in lengths):
        raise ConfigError(
            f"curriculum_learning's lengths {lengths} must split over --tensor-model-parallel-size "
            f"{t.tensor_parallel_size} under --sequence-parallel; make them multiples of it"
        )
    return curriculum
