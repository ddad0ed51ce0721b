"""Planned exits of a training run, as Megatron has them: on a signal (`--exit-signal-handler`,
what a scheduler sends before preemption), every `--exit-interval` iterations, or after
`--exit-duration-in-mins`. The handler only records the signal; all ranks agree at the next
iteration boundary (one small all-reduce), so they save the same checkpoint and exit together.
Without the handler, SIGTERM ends the process at once (megatron/entry_point.py).
"""

import signal
import time
from types import FrameType

import torch
import torch.distributed as dist

from megatron import comm
from megatron.config.flags import ExitConfig
from megatron.parallel import ParallelGrid


class ExitConditions:
    def __init__(self, config: ExitConfig, grid: ParallelGrid) -> None:
        self.config = config
        self.grid = grid
        self.started = time.monotonic()
        self.received: str | None = None
        self.previous_handler = None
        if config.signal_handler:
            self.previous_handler = signal.signal(signal.Signals[config.signal], self._record)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name

    def close(self) -> None:
        """Give the signal back to the handler it had before this run."""
        if self.previous_handler is not None:
            signal.signal(signal.Signals[self.config.signal], self.previous_handler)
            self.previous_handler = None

    def reason(self, iteration: int) -> str | None:
        """Why the run should save and exit after `iteration`, the same on every rank, or None."""
        cfg = self.config
        if cfg.interval and iteration % cfg.interval == 0:
            return f"--exit-interval {cfg.interval}"
        if not cfg.signal_handler and cfg.duration_minutes is None:
            return None
        minutes = (time.monotonic() - self.started) / 60
        flags = torch.tensor(
            [self.received is not None, cfg.duration_minutes is not None and minutes > cfg.duration_minutes],
            dtype=torch.float32,
            device=self.grid.device,
        )
        if self.grid.world_size > 1:
            comm.all_reduce(flags, op=dist.ReduceOp.MAX)
        signalled, timed_out = bool(flags[0]), bool(flags[1])
        if signalled:
            return f"received {self.received or cfg.signal} (--exit-signal-handler)"
        if timed_out:
            return f"ran {minutes:.1f} minutes, past --exit-duration-in-mins {cfg.duration_minutes:g}"
        return None
