"""Expert-load observability: per MoE layer, tokens per expert (max/mean imbalance), share of
routed choices dropped and router entropy, summed over a log interval and data-parallel ranks;
under pipeline parallelism every stage's layers, gathered from the stages."""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.model.moe.layer import RoutingStats
from megatron.parallel import all_reduce, is_parallel

SUMMED = ("tokens_per_expert_E", "dropped", "routed", "entropy_sum", "tokens")


@dataclass
class LayerLoad:
    layer: int  # 1-based layer number
    tokens_per_expert: list[int]
    imbalance: float  # max / mean tokens per expert
    dropped_fraction: float
    router_entropy: float  # mean over tokens, nats


class MoEMonitor:
    def __init__(self) -> None:
        self.sums: dict[int, dict[str, torch.Tensor]] = {}

    def accumulate(self, routing: dict[int, RoutingStats]) -> None:
        """Add one forward's statistics of this stage's MoE layers, by layer number (`GPTOutput.routing`)."""
        for number, stats in routing.items():
            totals = self.sums.setdefault(number, {})
            for key in SUMMED:
                value = getattr(stats, key)
                totals[key] = totals[key] + value if key in totals else value.clone()

    def report(self, group: dist.ProcessGroup | None, pp_group: dist.ProcessGroup | None = None) -> list[LayerLoad]:
        """Per-layer load since the last report, summed over `group` (the ranks of this pipeline
        stage), of every stage's layers (gathered over `pp_group`); resets the sums."""
        loads = []
        for number, totals in sorted(self.sums.items()):
            flat = torch.cat([totals[key].reshape(-1).double() for key in SUMMED])
            all_reduce(flat, group)
            counts, dropped, routed, entropy, tokens = flat.split([flat.numel() - 4, 1, 1, 1, 1])
            mean = counts.mean().item()
            loads.append(
                LayerLoad(
                    layer=number,
                    tokens_per_expert=[int(c) for c in counts.tolist()],
                    imbalance=counts.max().item() / mean if mean > 0 else 0.0,
                    dropped_fraction=dropped.item() / max(routed.item(), 1.0),
                    router_entropy=entropy.item() / max(tokens.item(), 1.0),
                )
            )
        self.sums.clear()
        if not is_parallel(pp_group):
            return loads
        stages: list[list[LayerLoad]] = [[] for _ in range(dist.get_world_size(pp_group))]
        dist.all_gather_object(stages, loads, group=pp_group)
        return sorted((load for stage in stages for load in stage), key=lambda load: load.layer)
