"""DeepSpeed's flops profiler API (`FlopsProfiler`, `get_model_profile` and the string helpers), so
that scripts written for `deepspeed.profiling.flops_profiler` run unchanged, counted our own way.

Counting: while the profiled model's forward runs, a TorchDispatchMode sees every aten op, those
inside custom autograd Functions (the CPU experts' `_LoopedExpertMLP`, the dispatch's all-to-all
and combine) included, and prices it with op_flops.py. Forward pre- and post-hooks keep the stack
of modules whose forwards are running; an op counts for every module on the stack (a module's
FLOPs include its children's) and, apart, for the innermost one. Latency is time.perf_counter
around each module's forward, after torch.cuda.synchronize() where the model is on a GPU.

MoE layers: each one's dispatch and combine, which are not modules, are the ops and time between
its submodules' hooks (moe_phases.py).

Unlike DeepSpeed, nothing is patched (torch.nn.functional stays as it is) and no attribute is set
on the modules: the counts live in the profiler, and end_profile() removes its hooks.
"""

import itertools
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from megatron.model.gpt import GPTModel
from megatron.model.moe.layer import MoELayer
from megatron.parallel import ParallelGrid
from megatron.profiling.moe_phases import MoETracker
from megatron.profiling.op_flops import Cost, op_cost
from megatron.profiling.records import ModuleProfile, ProfileHeader, StepTimes
from megatron.profiling.report import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
    profile_text,
)


class EngineLike(Protocol):
    """What the printed header reads of a DeepSpeed-style engine (ours: megatron.runtime.engine)."""

    parallel: ParallelGrid
    gradient_accumulation_steps: int


__all__ = [
    "FlopsProfiler",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]


@dataclass
class _ModuleStats:
    params: int
    cost: Cost = field(default_factory=Cost)
    self_cost: Cost = field(default_factory=Cost)
    duration_s: float = 0.0
    calls: int = 0


class _CountingMode(TorchDispatchMode):
    """Runs every op as it is and hands its cost to the profiler."""

    def __init__(self, profiler: "FlopsProfiler") -> None:
        super().__init__()
        self.profiler = profiler

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        cost = op_cost(func, args, out)
        if cost is not None:
            self.profiler._record(cost)
        return out


class FlopsProfiler:
    """Params, MACs, FLOPs and latency of each module of `model` over the forwards run between
    start_profile() and stop_profile(). `ds_engine` (our Engine) adds its parallel sizes to the
    printed header; `recompute_fwd_factor` (forwards that activation checkpointing reruns, per
    forward) enters the printed estimate of a training step's FLOPs. Parameters are counted whether
    or not they require gradients, this rank's only (under expert parallelism, its experts)."""

    def __init__(
        self, model: nn.Module, ds_engine: EngineLike | None = None, recompute_fwd_factor: float = 0.0
    ) -> None:
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self._handles: list[RemovableHandle] = []
        self._stats: dict[nn.Module, _ModuleStats] | None = None
        self._moe: dict[nn.Module, MoETracker] = {}
        self._stack: list[nn.Module] = []
        self._starts: list[float] = []
        self._mode: _CountingMode | None = None
        self._synchronize = False

    def start_profile(self, ignore_list: Iterable[type[nn.Module]] | None = None) -> None:
        """Count from the next forward on. Submodules of the types in `ignore_list` get no hooks,
        so their ops count for the module that calls them; the model itself is always profiled."""
        if self.started:
            raise RuntimeError("the flops profiler is already running; call stop_profile() before start_profile()")
        self.reset_profile()
        ignored = tuple(ignore_list or ())
        tensors = itertools.chain(self.model.parameters(), self.model.buffers())
        self._synchronize = any(t.is_cuda for t in tensors)
        # the first op under a dispatch mode imports torch._dynamo (a second on the CPU): not in a timed forward
        with _CountingMode(self):
            torch.zeros(())
        for module in self.model.modules():
            if module is not self.model and isinstance(module, ignored):
                continue
            self._handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting (the hooks go); the counts stay readable until end_profile()."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.started = False

    def reset_profile(self) -> None:
        """Zero every count (between profiled steps)."""
        self._stats = {m: _ModuleStats(sum(p.numel() for p in m.parameters())) for m in self.model.modules()}
        self._moe = {m: MoETracker(m) for m in self.model.modules() if isinstance(m, MoELayer)}

    def end_profile(self) -> None:
        """Stop counting and drop the counts: the model is left as it was before start_profile()."""
        self.stop_profile()
        self._stats = None
        self._moe = {}

    def get_total_flops(self, as_string: bool = False) -> int | str:
        flops = self.module_profile().cost.flops
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        macs = self.module_profile().cost.macs
        return macs_to_string(macs) if as_string else macs

    def get_total_params(self, as_string: bool = False) -> int | str:
        params = self.module_profile().params
        return params_to_string(params) if as_string else params

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """The model's forward latency in seconds, summed over the profiled forwards."""
        duration = self.module_profile().duration_s
        return duration_to_string(duration) if as_string else duration

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
        step_times: StepTimes | None = None,
    ) -> None:
        """The summary, the top modules by params, MACs and latency at each depth up to
        `module_depth` (-1: all), and with `detailed` the module tree; to `output_file` instead
        of stdout when given. `step_times`: the training step the forwards belong to (the engine's)."""
        engine = self.ds_engine
        header = ProfileHeader(
            profile_step,
            self.recompute_fwd_factor,
            None if engine is None else engine.parallel,
            None if engine is None else engine.gradient_accumulation_steps,
            step_times,
        )
        text = profile_text(self.module_profile(), header, module_depth, top_modules, detailed)
        if output_file is None:
            print(text)
        else:
            with open(output_file, "w") as f:
                f.write(text + "\n")

    def module_profile(self) -> ModuleProfile:
        """The counts as a tree of records, the model at its root."""
        if self._stats is None:
            raise RuntimeError("the flops profiler holds no profile; call start_profile() and run a forward first")
        return self._tree("", self.model)

    def _tree(self, name: str, module: nn.Module) -> ModuleProfile:
        stats = self._stats[module]
        children = [self._tree(f"{name}.{child}" if name else child, m) for child, m in module.named_children()]
        tracker = self._moe.get(module)
        cost, duration_s = stats.cost, stats.duration_s
        if stats.calls == 0:  # a container (ModuleList) whose parent calls its children: theirs summed
            cost, duration_s = Cost(), sum(child.duration_s for child in children)
            for child in children:
                cost.add(child.cost)
        return ModuleProfile(
            name,
            type(module).__name__,
            stats.params,
            cost,
            stats.self_cost,
            duration_s,
            stats.calls,
            children,
            None if tracker is None else tracker.profile,
        )

    def _now(self) -> float:
        if self._synchronize:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self._stack:  # the outermost forward: its ops are counted until it returns
            self._mode = _CountingMode(self)
            self._mode.__enter__()
        now = self._now()
        if self._stack and (tracker := self._moe.get(self._stack[-1])) is not None:
            tracker.child_starts(module, args, kwargs, now)
        self._stack.append(module)
        self._starts.append(now)

    def _leave(self, module: nn.Module, args: tuple[Any, ...], output: object) -> None:
        now = self._now()
        self._stack.pop()
        stats = self._stats[module]
        stats.duration_s += now - self._starts.pop()
        stats.calls += 1
        if (tracker := self._moe.get(module)) is not None:
            tracker.layer_ends(output, now)
        if self._stack and (tracker := self._moe.get(self._stack[-1])) is not None:
            tracker.child_ends(module, now)
        if not self._stack:
            self._mode.__exit__(None, None, None)
            self._mode = None

    def _record(self, cost: Cost) -> None:
        innermost = self._stack[-1]
        self._stats[innermost].self_cost.add(cost)
        for module in set(self._stack):  # once per module, even one that calls itself
            self._stats[module].cost.add(cost)
        if (tracker := self._moe.get(innermost)) is not None:
            tracker.add(cost)


def get_model_profile(
    model: nn.Module,
    input_shape: Sequence[int] | None = None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: Iterable[type[nn.Module]] | None = None,
    mode: str = "forward",
) -> tuple[int | str, int | str, int | str]:
    """(flops, macs, params) of one forward (mode "forward") or one `model.generate` call (mode
    "generate") on `args` and `kwargs`, after `warm_up` unprofiled ones; strings when `as_string`.

    With `input_shape` the input is one tensor of that shape: for a GPTModel token ids drawn
    uniformly from its vocabulary (its forward takes token ids), for any other model standard
    normal values in its parameters' dtype; on the model's device either way.
    """
    kwargs = dict(kwargs or {})
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile's mode is 'forward' or 'generate', not {mode!r}")
    if mode == "generate" and not hasattr(model, "generate"):
        raise ValueError(f"mode='generate' needs a model with a generate() method, and {type(model).__name__} has none")
    if input_shape is not None:
        args = [_sample_input(model, tuple(input_shape))]
    if not args and not kwargs:
        raise ValueError("get_model_profile needs the model's input: give input_shape, args or kwargs")
    run = model if mode == "forward" else model.generate
    for _ in range(warm_up):  # first calls compile kernels and probe fast paths, which would skew the latency
        run(*args, **kwargs)
    profiler = FlopsProfiler(model)
    profiler.start_profile(ignore_list=ignore_modules)
    run(*args, **kwargs)
    profiler.stop_profile()
    flops, macs, params = profiler.get_total_flops(), profiler.get_total_macs(), profiler.get_total_params()
    if print_profile:
        profiler.print_model_profile(
            module_depth=module_depth, top_modules=top_modules, detailed=detailed, output_file=output_file
        )
    profiler.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params


def _sample_input(model: nn.Module, shape: tuple[int, ...]) -> torch.Tensor:
    param = next(model.parameters(), None)
    device = torch.device("cpu") if param is None else param.device
    if isinstance(model, GPTModel):
        return torch.randint(0, model.config.vocab_size, shape, device=device)
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.get_default_dtype()
    return torch.randn(shape, device=device, dtype=dtype)
