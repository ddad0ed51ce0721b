"""The ds_config `flops_profiler` block in the engine, as DeepSpeed runs it: the forwards of step
`profile_step` (the engine's global_steps when they run, counted from 0) are profiled, every
micro-batch of that step included, and once that step's optimizer step is taken the first rank
prints the profile (to `output_file` if given) and the profiler's hooks are removed. Other steps
run without any hook. Under TP, PP and EP each rank profiles its own modules; the first rank's
profile adds every rank's totals, their sum and the slowest rank."""

import time

import torch
from torch import nn

from megatron.parallel import ParallelGrid
from megatron.profiling.flops_profiler import EngineLike, FlopsProfiler
from megatron.profiling.records import RankTotals, StepTimes
from megatron.runtime.config.schema import FlopsProfilerConfig


class ProfiledStep:
    def __init__(
        self, config: FlopsProfilerConfig, module: nn.Module, engine: EngineLike, grid: ParallelGrid, samples: int
    ) -> None:
        """`samples`: a step's global batch."""
        self.config = config
        self.grid = grid
        self.samples = samples
        self.profiler = FlopsProfiler(module, ds_engine=engine, recompute_fwd_factor=config.recompute_fwd_factor)
        self.began = 0.0
        self.done = False

    def before_forward(self, global_steps: int) -> None:
        if global_steps == self.config.profile_step and not self.done and not self.profiler.started:
            self.profiler.start_profile()
            self.began = self._now()

    def after_step(self, global_steps: int) -> None:
        """Called with the steps taken so far, the one just taken included."""
        if global_steps != self.config.profile_step + 1 or not self.profiler.started:
            return
        iteration_s = self._now() - self.began
        self.profiler.stop_profile()
        root = self.profiler.module_profile()
        mine = RankTotals(self.grid.rank, root.params, root.cost.flops, root.duration_s, iteration_s)
        times = StepTimes(iteration_s, self.samples, tuple(self.grid.gather_from_all(mine)))
        if self.grid.is_first_rank:
            c = self.config
            self.profiler.print_model_profile(
                c.profile_step, c.module_depth, c.top_modules, c.detailed, c.output_file, times
            )
        self.profiler.end_profile()
        self.done = True

    def _now(self) -> float:
        if self.grid.device.type == "cuda":
            torch.cuda.synchronize(self.grid.device)
        return time.perf_counter()
