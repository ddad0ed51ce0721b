"""How long a run trains and the tokens each iteration counts, as Megatron-DeepSpeed counts them.

An iteration counts its global batch times its sequence length: a curriculum's shorter length, and
under random-LTD the length averaged over the layers, each random-LTD layer counting only the tokens
it keeps ((length x (L - n) + kept x n) // L for n of L layers, Megatron-DeepSpeed's
`actual_seq_length`). `--train-tokens` stops the run once the counted tokens reach it and, given
with `--train-iters` or `--train-samples`, at whichever comes first, as in Megatron-DeepSpeed.
Every length is a function of the iteration alone, so the run's iterations are known before it
starts: the datasets are built for them and a resumed run stops where the uninterrupted one did."""

from dataclasses import dataclass

from megatron.config.flags import PretrainConfig
from megatron.training.curriculum import CurriculumSchedule, sequence_curriculum
from megatron.training.random_ltd_schedule import RandomLTDSchedule, random_ltd_for


@dataclass(frozen=True)
class RunLength:
    train_iters: int
    lr_decay_tokens: int  # the LR decay's length: the flags', else the whole run's counted tokens


class TokenCount:
    """The sequence length each training iteration reads and the tokens it counts."""

    def __init__(
        self, run: PretrainConfig, curriculum: CurriculumSchedule | None, random_ltd: RandomLTDSchedule | None
    ) -> None:
        self.global_batch_size, self.full_length = run.training.global_batch_size, run.training.seq_length
        self.num_layers = run.model.num_layers
        self.curriculum, self.random_ltd = curriculum, random_ltd

    @classmethod
    def of(cls, run: PretrainConfig) -> "TokenCount":
        efficiency = run.runtime.data_efficiency
        return cls(
            run, sequence_curriculum(run.runtime.curriculum_learning, efficiency, run), random_ltd_for(efficiency, run)
        )

    @property
    def schedules(self) -> bool:
        return self.curriculum is not None or self.random_ltd is not None

    def seq_length(self, iteration: int) -> int:
        """Training iteration `iteration`'s (from 1) sequence length: the curriculum's, else --seq-length."""
        return self.full_length if self.curriculum is None else self.curriculum.difficulty(iteration)

    def tokens(self, iteration: int) -> int:
        """The tokens iteration `iteration` (from 1) counts towards --train-tokens and the LR schedule."""
        length = self.seq_length(iteration)
        if self.random_ltd is not None:
            kept, dropping = self.random_ltd.kept_length(iteration), len(self.random_ltd.layers.layer_ids)
            if kept < length:
                length = (length * (self.num_layers - dropping) + kept * dropping) // self.num_layers
        return self.global_batch_size * length


def run_length(run: PretrainConfig, count: TokenCount | None = None) -> RunLength:
    """`count`: the run's token count where the caller has it (else made from the run's config)."""
    t = run.training
    count = count or TokenCount.of(run)
    if t.train_tokens is None or not count.schedules:  # every iteration counts whole sequences
        iterations = t.train_iters
        if t.train_tokens is not None:
            iterations = min(iterations, -(-t.train_tokens // t.tokens_per_iteration))
        counted = iterations * t.tokens_per_iteration
    else:
        cap = None if t.train_length.unit == "tokens" else t.train_iters
        iterations, counted = 0, 0
        while counted < t.train_tokens and (cap is None or iterations < cap):
            iterations += 1
            counted += count.tokens(iterations)
    if t.lr_decay is not None or t.train_tokens is None:
        return RunLength(iterations, t.lr_decay_tokens)
    return RunLength(iterations, counted)
