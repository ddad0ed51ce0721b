"""Megatron's timers (`--timing-log-level`, `--timing-log-option`): named wall-clock timers around
the parts of an iteration, each with the level at which it runs, summed over a log interval and
reported per iteration across ranks (the max, the min and max, or every rank's).

Code marks a part with `with timed(name):`. While no `Timers` is installed, or the part's level
is above the installed one's, that is an attribute read, a lookup and a shared empty context: no
clock, no device synchronisation. Installed timers are the process's (megatron/installed.py), for
the scope of `Timers.recording()`."""

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Literal

import torch

from megatron import comm
from megatron.installed import Installed

# every timer, in the order the log prints them, with the level it runs at (Megatron's names and
# levels, but for save-checkpoint: level 0 here is no timer at all); each is reported per iteration
# of the interval, but for the timers in PER_INTERVAL, the interval's total
LEVELS: dict[str, int] = {
    "forward-backward": 1,
    "forward-compute": 2,
    "backward-compute": 2,
    "batch-generator": 2,
    "forward-recv": 2,
    "forward-send": 2,
    "backward-recv": 2,
    "backward-send": 2,
    "forward-send-backward-recv": 2,
    "backward-send-forward-recv": 2,
    "pipeline-bubble": 2,
    "moe-dispatch-all-to-all": 2,
    "moe-combine-all-to-all": 2,
    "all-grads-sync": 1,
    "optimizer": 1,
    "params-all-gather": 1,
    "nvme-swap-read": 2,
    "nvme-swap-write": 2,
    "save-checkpoint": 1,
}
PER_INTERVAL = frozenset({"save-checkpoint"})
LogOption = Literal["max", "minmax", "all"]
OFF = nullcontext()


class _Timer:
    """One named timer: the outermost of nested starts counts."""

    def __init__(self, sync: bool) -> None:
        self.sync = sync
        self.elapsed_s = 0.0
        self.depth = 0
        self.began = 0.0

    def __enter__(self) -> None:
        if self.depth == 0:
            if self.sync:
                torch.cuda.synchronize()
            self.began = time.perf_counter()
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1
        if self.depth == 0:
            if self.sync:
                torch.cuda.synchronize()
            self.elapsed_s += time.perf_counter() - self.began


@dataclass(frozen=True)
class TimerReading:
    """One timer's milliseconds per iteration over an interval, on every rank (rank order)."""

    name: str
    ms_per_rank: list[float]

    @property
    def max_ms(self) -> float:
        return max(self.ms_per_rank)

    @property
    def min_ms(self) -> float:
        return min(self.ms_per_rank)


class Timers:
    def __init__(self, log_level: int, log_option: LogOption = "minmax", device: torch.device | None = None) -> None:
        if log_level not in (0, 1, 2):
            raise ValueError(f"timing log level {log_level} is not 0, 1 or 2")
        self.log_level = log_level
        self.log_option = log_option
        self.device = device or torch.device("cpu")  # the run's, where its collectives take tensors
        sync = self.device.type == "cuda"
        self.timers = {name: _Timer(sync) for name, level in LEVELS.items() if level <= log_level}

    def readings(self, iterations: int, reset: bool = True) -> list[TimerReading]:
        """Every timer that ran on some rank, per iteration over the last `iterations` (PER_INTERVAL's:
        in all); a collective over the world (each rank calls it at the same log line)."""
        names = list(self.timers)
        mine = torch.tensor([self.timers[name].elapsed_s for name in names], dtype=torch.float64)
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        every = mine.unsqueeze(0)
        if world > 1:
            gathered = torch.empty(world * len(names), dtype=torch.float64, device=self.device)
            comm.all_gather_into_tensor(gathered, mine.to(self.device))
            every = gathered.view(world, len(names)).cpu()
        if reset:
            for timer in self.timers.values():
                timer.elapsed_s = 0.0
        divisors = torch.tensor([1 if name in PER_INTERVAL else max(iterations, 1) for name in names])
        ms = every * 1000.0 / divisors
        return [TimerReading(name, ms[:, i].tolist()) for i, name in enumerate(names) if ms[:, i].max() > 0]

    def log_text(self, readings: list[TimerReading]) -> str:
        """Megatron's block: `(min, max) time across ranks (ms):` and a dotted line per timer."""
        if self.log_option == "all":
            lines = ["times across ranks (ms):"]
            for reading in readings:
                lines.append(f"  {reading.name}:")
                lines += [f"     rank {rank:2d}: {ms:.2f}" for rank, ms in enumerate(reading.ms_per_rank)]
            return "\n".join(lines)
        header = "max time across ranks (ms):" if self.log_option == "max" else "(min, max) time across ranks (ms):"
        lines = [header]
        for reading in readings:
            dots = "." * max(1, 48 - len(reading.name))
            value = (
                f"{reading.max_ms:.2f}" if self.log_option == "max" else f"({reading.min_ms:.2f}, {reading.max_ms:.2f})"
            )
            lines.append(f"    {reading.name} {dots}: {value}")
        return "\n".join(lines)

    @contextmanager
    def recording(self) -> Iterator["Timers"]:
        with INSTALLED.holding(self):
            yield self


INSTALLED: Installed[Timers] = Installed()


def untimed() -> AbstractContextManager[None]:
    """Work inside that no timer counts (evaluation: its forwards are not the iteration's)."""
    return INSTALLED.holding(None)


def timed(name: str) -> AbstractContextManager[None]:
    """The named part (a name in LEVELS) timed if the installed timers run its level; else nothing."""
    timers = INSTALLED.value
    return OFF if timers is None else timers.timers.get(name, OFF)
