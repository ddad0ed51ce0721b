"""Which layers a pipeline stage holds (Megatron's split): the first stage also holds the
embeddings, the last the final norm and the LM head (and, with tied embeddings, a copy of the word
embedding whose gradient is summed with the first stage's). The layers are split evenly, or the
first and last stages take the counts `--decoder-first-pipeline-num-layers` and
`--decoder-last-pipeline-num-layers` give and the stages between share the rest evenly.
"""

from dataclasses import dataclass

from megatron.errors import ConfigError


@dataclass(frozen=True)
class PipelineStage:
    rank: int
    size: int
    first_layer: int  # global index of this stage's first layer
    num_layers: int

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)


def layer_counts(num_layers: int, pp_size: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Layers per stage, first to last."""
    if pp_size == 1:
        return [num_layers]
    fixed = [count for count in (first, last) if count is not None]
    middle_stages = pp_size - len(fixed)
    rest = num_layers - sum(fixed)
    if (
        any(count < 1 for count in fixed)
        or rest < (middle_stages if middle_stages else 0)
        or (middle_stages and rest % middle_stages)
        or (not middle_stages and rest)
    ):
        given = "".join(
            f" --decoder-{name}-pipeline-num-layers {count}"
            for name, count in (("first", first), ("last", last))
            if count is not None
        )
        raise ConfigError(
            f"--num-layers {num_layers} cannot be split over --pipeline-model-parallel-size {pp_size}{given}: "
            "every stage needs at least one layer and the stages without a given count an equal share; "
            "change the layer counts or the pipeline-parallel size"
        )
    share = rest // middle_stages if middle_stages else 0
    counts = [share] * pp_size
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def pipeline_stage(
    num_layers: int, pp_size: int, pp_rank: int, first: int | None = None, last: int | None = None
) -> PipelineStage:
    counts = layer_counts(num_layers, pp_size, first, last)
    return PipelineStage(pp_rank, pp_size, sum(counts[:pp_rank]), counts[pp_rank])
