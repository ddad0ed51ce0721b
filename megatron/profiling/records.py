"""The profile the profiler hands to the printer: one record per module, in the model's tree, with
each MoE layer's dispatch, combine and expert load beside it."""

from dataclasses import dataclass, field

from megatron.parallel import ParallelGrid
from megatron.profiling.op_flops import Cost


@dataclass
class PhaseProfile:
    """Code that runs between two modules' hooks rather than in a module of its own."""

    cost: Cost = field(default_factory=Cost)
    duration_s: float = 0.0


@dataclass
class MoEProfile:
    """An MoE layer's dispatch (sort, permutation, all-to-all: from the router's end to the experts'
    start), its combine (the return all-to-all and the gate-weighted sum: from the experts' end to
    the layer's next submodule or its end), and its experts' load, summed over the profiled forwards."""

    dispatch: PhaseProfile
    combine: PhaseProfile
    routed_per_expert: list[int]  # routed choices per expert of the layer, before capacity drops
    received_per_expert: list[int]  # rows this rank's experts computed (after drops, from every rank)
    macs_per_row: int  # one row through one expert's two GEMMs

    @property
    def active_gemm_flops(self) -> list[int]:
        """Each local expert's GEMM FLOPs for the rows it received (without any padding rows)."""
        return [2 * rows * self.macs_per_row for rows in self.received_per_expert]


@dataclass
class ModuleProfile:
    name: str  # qualified name in the model, "" for the model itself
    kind: str  # class name
    params: int  # its parameters, its children's included, each tensor once
    cost: Cost  # ops of its forwards, its children's included (a container never called: its children's)
    self_cost: Cost  # ops of its forwards outside any child module
    duration_s: float  # wall time of its forwards, summed
    calls: int
    children: list["ModuleProfile"]
    moe: MoEProfile | None = None


@dataclass(frozen=True)
class RankTotals:
    """One rank's part of a profiled step (under TP, PP and EP each rank profiles its own)."""

    rank: int
    params: int
    fwd_flops: int
    fwd_latency_s: float
    iteration_s: float


@dataclass(frozen=True)
class StepTimes:
    """A whole training step around the profiled forwards, as the engine saw it."""

    iteration_s: float  # from the step's first forward to the end of its optimizer step
    samples: int  # the step's global batch
    ranks: tuple[RankTotals, ...] = ()  # every rank's, in rank order, when there are several


@dataclass
class ProfileHeader:
    step: int
    recompute_fwd_factor: float  # forwards rerun by activation checkpointing, per forward
    grid: ParallelGrid | None  # the engine's, when the profiler was given one
    gradient_accumulation_steps: int | None
    times: StepTimes | None = None  # when the engine profiled a training step
