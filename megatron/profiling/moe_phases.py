"""An MoE layer's dispatch and combine, and its experts' load, seen from the profiler's hooks.

Dispatch and combine are functions (megatron/model/moe/dispatch.py), not modules, so they are
told apart by the hooks of the layer's submodules: the ops and time between the router's end and
the experts' start are the dispatch (sort, permutation, the all-to-all to the experts' ranks);
those between the experts' end and the layer's next submodule (the PR-MoE coefficient, the shared
expert) or its end are the combine (the return all-to-all, the gate-weighted sum, and, where no
submodule follows, the layer's loss and statistics arithmetic). The experts' pre-hook reads the
rows each local expert receives, the layer's post-hook its routing statistics. Without expert
parallelism the experts gather their rows themselves, so that gather counts for the experts.
"""

from typing import Any

import torch
from torch import nn

from megatron.model.moe.layer import MoELayer, MoEOutput
from megatron.profiling.op_flops import Cost
from megatron.profiling.records import MoEProfile, PhaseProfile


class MoETracker:
    """One MoE layer's phases and load, fed by the profiler's hooks and the ops it counts."""

    def __init__(self, layer: MoELayer) -> None:
        self.layer = layer
        w1, w2 = layer.experts.w1, layer.experts.w2
        self.profile = MoEProfile(
            PhaseProfile(),
            PhaseProfile(),
            routed_per_expert=[0] * layer.num_experts,
            received_per_expert=[0] * w1.shape[0],
            macs_per_row=w1.shape[1] * w1.shape[2] + w2.shape[1] * w2.shape[2],
        )
        self._phase: PhaseProfile | None = None  # None: the layer's own code outside both phases
        self._since = 0.0

    def add(self, cost: Cost) -> None:
        if self._phase is not None:
            self._phase.cost.add(cost)

    def child_starts(self, child: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], now: float) -> None:
        self._close(now)
        if child is self.layer.experts:  # forward(x, counts_El, token_N=None)
            counts_El = args[1] if len(args) > 1 else kwargs["counts_El"]
            _accumulate(self.profile.received_per_expert, counts_El)

    def child_ends(self, child: nn.Module, now: float) -> None:
        if child is self.layer.router:
            self._phase, self._since = self.profile.dispatch, now
        elif child is self.layer.experts:
            self._phase, self._since = self.profile.combine, now

    def layer_ends(self, output: object, now: float) -> None:
        self._close(now)
        if isinstance(output, MoEOutput):
            _accumulate(self.profile.routed_per_expert, output.routing.tokens_per_expert_E)

    def _close(self, now: float) -> None:
        if self._phase is not None:
            self._phase.duration_s += now - self._since
            self._phase = None


def _accumulate(totals: list[int], counts: torch.Tensor) -> None:
    for i, count in enumerate(counts.tolist()):
        totals[i] += count
