"""Random layerwise token dropping (random-LTD, Yao et al. 2022; DeepSpeed's data_routing): each
chosen layer sees a random subset of each sequence's positions, kept in their order, and the
positions it does not see pass it unchanged. Causal attention among the kept tokens in order is
DeepSpeed's sliced attention mask; rotary positions stay the tokens' own. An MoE layer among them
routes the kept tokens only. Only in training: evaluation and generation see every token.

Each layer draws its own subset for each sample, from a generator seeded by the run's seed, the
iteration and the micro-batch, so every tensor-parallel rank draws the same one and a resumed run
draws what the uninterrupted one would have."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron.model.tensor_parallel import TensorParallel, gather_whole_sequence, scatter_to_sequence_region
from megatron.model.transformer import BlockOutput


@dataclass
class RandomLTD:
    layer_ids: frozenset[int]  # global layer indices (from 0), as random_ltd_layer_id lists them
    seed: int
    kept: int = 0  # this iteration's kept length; 0 or the whole sequence: every token
    iteration: int = 0
    forwards: int = 0  # training forwards so far in this iteration (its micro-batches)

    def begin_iteration(self, iteration: int, kept: int) -> None:
        self.iteration, self.kept, self.forwards = iteration, kept, 0

    def kept_positions(self, batch: int, seq: int, layers: list[int], device: torch.device) -> dict[int, torch.Tensor]:
        """For each of `layers` that drops tokens, the kept positions of each sample [B, K], sorted."""
        dropping = sorted(set(layers) & self.layer_ids)
        if not dropping or not 0 < self.kept < seq:
            return {}
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + self.iteration) * 1009 + self.forwards)
        self.forwards += 1
        scores_LBS = torch.rand(len(dropping), batch, seq, generator=generator)
        kept_LBK = scores_LBS.argsort(-1)[..., : self.kept].sort(-1).values.to(device)
        return dict(zip(dropping, kept_LBK))


def through_kept_tokens(
    run: Callable[[torch.Tensor, torch.Tensor], BlockOutput],
    x_BSH: torch.Tensor,
    position_ids_BS: torch.Tensor,
    kept_BK: torch.Tensor,
    tp: TensorParallel,
) -> BlockOutput:
    """`run` (a transformer layer) on the kept positions of x; the others pass unchanged. Under
    sequence parallelism x holds this rank's share of the positions: the whole sequence is
    gathered, the kept tokens shared out again for the layer, and its output put back the same way."""
    whole_BSH = gather_whole_sequence(x_BSH, tp.group) if tp.sequence_parallel else x_BSH
    index_BKH = kept_BK.unsqueeze(-1).expand(-1, -1, whole_BSH.shape[-1])
    part_BKH = whole_BSH.gather(1, index_BKH)
    if tp.sequence_parallel:
        part_BKH = scatter_to_sequence_region(part_BKH, tp.group)
    block = run(part_BKH, position_ids_BS.gather(1, kept_BK))
    out_BKH = gather_whole_sequence(block.hidden_BSH, tp.group) if tp.sequence_parallel else block.hidden_BSH
    whole_BSH = whole_BSH.scatter(1, index_BKH, out_BKH)
    if tp.sequence_parallel:
        whole_BSH = scatter_to_sequence_region(whole_BSH, tp.group)
    return BlockOutput(whole_BSH, block.router_loss, block.routing)
