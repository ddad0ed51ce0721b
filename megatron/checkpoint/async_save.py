"""Megatron-Core's `--async-save`: a checkpoint written in the background while training goes on.

At the save every rank, together, takes the synchronous save's checks and makes its staging
folder (save.py's prepare_save), copies its state into host memory (page-locked from a GPU) and
hands the copy to a writer thread: training continues at once. The thread writes the rank's files
as a synchronous save does (checksummed as written, each fsync'd) and takes no collective. Each
iteration while a save is in flight the ranks ask each other whether every writer is done (one
small gather); once all are, they finish it as a synchronous save ends (finish_save: the manifest,
the rename into place) and `latest` moves. So `latest` moves only when every rank's files are
durable, a kill at any point leaves the previous checkpoint as `latest`, a failed write stops the
run at the iteration that learns of it, and at most one save is in flight: the next waits for it."""

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from megatron.checkpoint.iterations import Log, point_latest
from megatron.checkpoint.layout import iteration_tag
from megatron.checkpoint.manifest import RunRecord
from megatron.checkpoint.save import (
    EngineState,
    PreparedSave,
    RankWrite,
    finish_save,
    prepare_save,
    state_nonfinite,
    write_rank_files,
)
from megatron.parallel import ParallelGrid


@dataclass(frozen=True)
class SavedCheckpoint:
    iteration: int
    folder: Path
    seconds: float  # from the save's start until `latest` moved
    blocked_seconds: float  # what training waited for at the save: the checks and the copy


@dataclass
class _InFlight:
    iteration: int
    save_dir: str
    prepared: PreparedSave
    state: EngineState  # the live state saved (the writer holds its own copy of its tensors)
    run: RunRecord | None
    writing: "Future[RankWrite]"
    copied: threading.Event  # set once the writer no longer reads the live tensors
    started: float
    blocked_seconds: float = 0.0  # what training waited: the checks, the copy or the wait for it


def _copy_then_write(prepared: PreparedSave, state: EngineState, copied: threading.Event) -> RankWrite:
    """The writer's whole job for an overlapped save: the copy, the finiteness check on it, the files."""
    try:
        copy = host_copy(state)
    finally:
        copied.set()  # also when the copy failed: nothing waits for ever
    bad = state_nonfinite(copy)
    return RankWrite({}, None, nonfinite=bad) if bad else write_rank_files(prepared.staging, copy)


def _host_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    copies = {}
    for name, tensor in tensors.items():
        copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        copies[name] = copy.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
    return copies


def host_copy(state: EngineState) -> EngineState:
    """`state` with every tensor copied into host memory, so that training may change the originals."""
    own = state.rank_own
    copied = replace(
        state,
        model=_host_copies(state.model),
        optimizer=_host_copies(state.optimizer),
        rank_own=None if own is None else replace(own, tensors=_host_copies(own.tensors)),
    )
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the non-blocking copies out of the device have landed
    return copied


class AsyncCheckpointSaver:
    """At most one checkpoint in flight; `poll` each iteration, `wait` before an exit or another save."""

    def __init__(self, grid: ParallelGrid, log: Log) -> None:
        self.grid, self.log = grid, log
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self.in_flight: _InFlight | None = None

    def start(
        self, state: EngineState, save_dir: str, iteration: int, run: RunRecord | None, overlap: bool = False
    ) -> SavedCheckpoint | None:
        """Begin saving `state` as `save_dir/iter_N/` (every rank, together); returns the save that was
        still in flight, which it finished first. With `overlap` the copy (and the finiteness check on
        it) is the writer's too, and the caller must `wait_for_copy()` before anything changes the
        state's tensors (the next optimizer step): valid where nothing else does."""
        began, previous = time.perf_counter(), None
        if self.in_flight is not None:
            self.log(
                f" > waiting for the checkpoint of iteration {self.in_flight.iteration} to be written before "
                f"saving iteration {iteration} (at most one save is in flight)"
            )
            previous = self.wait()
        prepared = prepare_save(state, Path(save_dir) / iteration_tag(iteration), check_finite=not overlap)
        copied = threading.Event()
        if overlap:
            writing = self.pool.submit(_copy_then_write, prepared, state, copied)
        else:
            copy = host_copy(state)
            copied.set()
            writing = self.pool.submit(write_rank_files, prepared.staging, copy)
        self.in_flight = _InFlight(iteration, save_dir, prepared, state, run, writing, copied, began)
        self.in_flight.blocked_seconds += time.perf_counter() - began
        return previous

    def wait_for_copy(self) -> None:
        """Return once the save in flight holds its own copy of the state (at once when it does)."""
        flight = self.in_flight
        if flight is not None and not flight.copied.is_set():
            began = time.perf_counter()
            flight.copied.wait()
            flight.blocked_seconds += time.perf_counter() - began

    def poll(self) -> SavedCheckpoint | None:
        """The save in flight, finished, if every rank's writer is done (a gather over the ranks
        while one is in flight), else None; a failed write raises CheckpointError."""
        if self.in_flight is None or not all(self.grid.gather_from_all(self.in_flight.writing.done())):
            return None
        return self._finish()

    def wait(self) -> SavedCheckpoint | None:
        """Finish the save in flight, waiting for its writer (every rank, together); None when none is."""
        return None if self.in_flight is None else self._finish()

    def _finish(self) -> SavedCheckpoint:
        flight, self.in_flight = self.in_flight, None
        assert flight is not None
        folder = finish_save(flight.prepared, flight.state, flight.writing.result(), flight.run)
        point_latest(flight.save_dir, flight.iteration, self.grid)
        return SavedCheckpoint(flight.iteration, folder, time.perf_counter() - flight.started, flight.blocked_seconds)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
