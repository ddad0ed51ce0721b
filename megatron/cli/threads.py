"""The CPU threads a training process uses, chosen before torch loads: OpenMP reads
OMP_NUM_THREADS and OMP_WAIT_POLICY once, when the library is loaded, so they cannot be changed
later. Nothing here imports torch.

Idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE) instead of spinning: on a shared or busy
machine a spinning thread burns the core that a descheduled peer needs, and a step stalls (on 2
loaded cores a single-process run fell from about 4,200 to 300-500 tokens/s; with PASSIVE it kept
1,066-2,313). The thread count is the cores this process may run on, shared among the processes
of this node (torchrun's LOCAL_WORLD_SIZE). A value the user set in the environment always wins;
note that torchrun itself sets OMP_NUM_THREADS=1 for more than one process per node unless it is set.
"""

import os
from collections.abc import MutableMapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadChoice:
    threads: str
    wait_policy: str
    chosen_here: bool  # False when the environment set both

    def describe(self) -> str:
        source = "set by the environment" if not self.chosen_here else "chosen for this machine"
        return (
            f" > CPU threads per process: {self.threads}, OMP_WAIT_POLICY={self.wait_policy} ({source}; "
            "set OMP_NUM_THREADS / OMP_WAIT_POLICY to choose)"
        )


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def choose_threads(environ: MutableMapping[str, str]) -> ThreadChoice:
    """Fill in OMP_NUM_THREADS and OMP_WAIT_POLICY where `environ` lacks them."""
    chosen_here = "OMP_NUM_THREADS" not in environ or "OMP_WAIT_POLICY" not in environ
    local_processes = max(int(environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    environ.setdefault("OMP_NUM_THREADS", str(max(usable_cores() // local_processes, 1)))
    environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return ThreadChoice(environ["OMP_NUM_THREADS"], environ["OMP_WAIT_POLICY"], chosen_here)
