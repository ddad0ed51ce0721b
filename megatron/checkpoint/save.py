"""The save protocol, the same for every checkpoint:

1. every rank checks that its tensors are finite and the first rank that the disk has room:
   either failing stops here, before anything is written;
2. the first rank makes `iter_N.tmp/` (removing a leftover one); every rank writes its files
   into it, each one checksummed as it is written and fsync'd in a thread while the next is;
3. all ranks agree that every write succeeded (else the partial folder is removed and the run
   stops with one sentence);
4. the first rank writes the manifest, flushes the folder, moves an existing `iter_N/` aside to
   `iter_N.old/`, renames `iter_N.tmp/` to `iter_N/`, flushes the directory and removes the old one.

A crash at any point leaves every earlier checkpoint as it was; `iterations.py` moves `latest`
only after step 4, and cleans up what a crash left behind. Steps 1-2 (prepare_save), the writing
(write_rank_files, which takes no collective) and steps 3-4 (finish_save) are separate so that
an asynchronous save (async_save.py) writes in a thread between the two that the ranks take together.
"""

import errno
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError

from megatron.checkpoint.durable import fsync_path, replace_durably
from megatron.checkpoint.layout import COMPRESSION, MODEL, OPTIMIZER, RNG, rank_file, replaced_folder, staging_folder
from megatron.checkpoint.manifest import (
    FORMAT_VERSION,
    EngineRecord,
    FileRecord,
    LayoutRecord,
    Manifest,
    RunRecord,
    write_manifest,
)
from megatron.checkpoint.tensor_file import Opener
from megatron.checkpoint.tensors import RngState, pack_by_size, rng_state, save_tensors
from megatron.errors import CheckpointError
from megatron.parallel import ParallelGrid

_FILE_OVERHEAD_BYTES = 64 << 10  # safetensors headers, the manifest: generous per file
PART_BYTES = 256 << 20  # a rank's tensors go into files of about this size


@dataclass
class RankOwnState:
    """Tensors that fit only the rank holding them (a 1-bit optimizer's error feedback), with the
    metadata a run on another layout needs to re-split them."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass
class EngineState:
    """What one rank writes: its model and optimizer entries, its own state, and (first rank) the
    engine's record."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    engine: EngineRecord | None
    grid: ParallelGrid
    zero_stage: int
    precision: str
    rank_own: RankOwnState | None = None
    rng: RngState = field(default_factory=rng_state)  # taken when the state is
    opener: Opener | None = None  # how its files are written (aio_writer.py); None: buffered writes

    def tensor_sets(self) -> list[dict[str, torch.Tensor]]:
        return [self.model, self.optimizer, *([self.rank_own.tensors] if self.rank_own else [])]


def first_nonfinite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an infinity. Its minimum and
    maximum tell (NaN propagates through both), at about 40x the speed of isfinite().all()."""
    for name, tensor in tensors.items():
        if (
            tensor.is_floating_point()
            and tensor.numel()
            and not bool(torch.isfinite(torch.stack(torch.aminmax(tensor))).all())
        ):
            return name
    return None


def state_nonfinite(state: EngineState) -> str | None:
    """The name of the state's first tensor holding a NaN or an infinity, if any."""
    return next((name for tensors in state.tensor_sets() if (name := first_nonfinite(tensors))), None)


def _refuse_nonfinite(state: EngineState, final: Path) -> None:
    bad = state_nonfinite(state)
    found = [(rank, name) for rank, name in enumerate(state.grid.gather_from_all(bad)) if name]
    if found:
        raise _nonfinite_error(*found[0], final)


def _nonfinite_error(rank: int, name: str, final: Path) -> CheckpointError:
    return CheckpointError(
        f"{name} holds a NaN or an infinity on rank {rank}, so {final} was not written and the latest checkpoint "
        "is unchanged; the run diverged: resume from that checkpoint with a lower --lr or check the data"
    )


def _bytes_needed(state: EngineState) -> int:
    local = sum(t.nbytes for part in state.tensor_sets() for t in part.values())
    files = 4 + local // PART_BYTES
    return sum(state.grid.gather_from_all(local + files * _FILE_OVERHEAD_BYTES))


def _refuse_full_disk(needed: int, free: int, final: Path) -> None:
    if needed > free:
        raise CheckpointError(
            f"saving {final} needs about {needed:,} bytes but its disk has {free:,} free; nothing was written and "
            "earlier checkpoints are intact; free space or point --save at a larger disk"
        )


def _parts(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Entries packed into files of about PART_BYTES each (a larger tensor gets one of its own)."""
    return [dict(part) for part in pack_by_size(list(tensors.items()), lambda entry: entry[1].nbytes, PART_BYTES)]


class _RankWriter:
    """Writes one rank's files into the staging folder (each checksummed as it is written) while a
    thread fsyncs each file already written; files are cut into parts so that the last one's work
    after its write is short."""

    def __init__(self, folder: Path, opener: Opener | None) -> None:
        self.folder, self.opener = folder, opener
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.pending: dict[str, tuple[Future[None], FileRecord]] = {}

    def _written(self, name: str, record: FileRecord) -> None:
        self.pending[name] = (self.pool.submit(fsync_path, self.folder / name), record)

    def tensors(
        self, stem: str, rank: int, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
    ) -> None:
        for part, entries in enumerate(_parts(tensors)):
            name = rank_file(stem, rank, part)
            self._written(name, save_tensors(self.folder / name, entries, metadata, self.opener))

    def rng(self, rank: int, state: RngState) -> None:
        name = rank_file(RNG, rank)
        self._written(name, save_tensors(self.folder / name, state.tensors, state.metadata, self.opener))

    def records(self) -> dict[str, FileRecord]:
        try:
            for flushed, _ in self.pending.values():
                flushed.result()
            return {name: record for name, (_, record) in self.pending.items()}
        finally:
            self.pool.shutdown()


@dataclass(frozen=True)
class RankWrite:
    """What writing one rank's files gave: their records, or the error that stopped it."""

    records: dict[str, FileRecord]
    error: str | None
    nonfinite: str | None = None  # an asynchronous save's copy held a NaN here: nothing was written


def write_rank_files(staging: Path, state: EngineState) -> RankWrite:
    """This rank's files, written into the staging folder; no collective, so a thread can do it."""
    rank = state.grid.rank
    writer = _RankWriter(staging, state.opener)
    try:
        writer.rng(rank, state.rng)
        writer.tensors(MODEL, rank, state.model)
        writer.tensors(OPTIMIZER, rank, state.optimizer)
        if state.rank_own is not None:
            writer.tensors(COMPRESSION, rank, state.rank_own.tensors, state.rank_own.metadata)
        return RankWrite(writer.records(), None)
    except (OSError, SafetensorError) as error:  # safetensors reports a full disk as its own error
        writer.pool.shutdown(cancel_futures=True)
        return RankWrite({}, _reason(error))


def _reason(error: Exception) -> str:
    """The error's words for the sentence, its errno's name first where its message lacks it (the
    aio op says what it was doing: "reserving ... bytes at file offset ...")."""
    text = getattr(error, "strerror", None) or str(error)
    code = getattr(error, "errno", None)
    if code and os.strerror(code) not in text:
        return f"{os.strerror(code)}: {text}"
    return text


def layout_record(grid: ParallelGrid) -> LayoutRecord:
    return LayoutRecord(
        world_size=grid.world_size,
        tensor_parallel_size=grid.tp_size,
        pipeline_parallel_size=grid.pp_size,
        data_parallel_size=grid.dp_size,
        expert_parallel_size=grid.ep_size,
        expert_tensor_parallel_size=grid.expert_tp_size,
    )


def _move_into_place(staging: Path, final: Path) -> None:
    replaced = replaced_folder(final)
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)  # left by a crash while iteration N was replaced before
        os.replace(final, replaced)
    replace_durably(staging, final)
    shutil.rmtree(replaced, ignore_errors=True)


def _finish(
    staging: Path, final: Path, state: EngineState, files: dict[str, FileRecord], run: RunRecord | None
) -> None:
    assert state.engine is not None, "the first rank's state carries the engine's record"
    write_manifest(
        staging,
        Manifest(
            format_version=FORMAT_VERSION,
            run=run,
            layout=layout_record(state.grid),
            engine=state.engine,
            zero_stage=state.zero_stage,
            precision=state.precision,
            files=dict(sorted(files.items())),
        ),
    )
    fsync_path(staging)
    _move_into_place(staging, final)


@dataclass(frozen=True)
class PreparedSave:
    """A save that passed its checks, with its staging folder made: what the ranks write into."""

    staging: Path
    final: Path
    needed: int  # bytes, every rank's, for the message of a full disk


def prepare_save(state: EngineState, final: Path, check_finite: bool = True) -> PreparedSave:
    """Steps 1-2 of the protocol before the writing (every rank, together); without `check_finite`
    the writer checks its copy and finish_save refuses what it found."""
    grid = state.grid
    if check_finite:
        _refuse_nonfinite(state, final)
    needed = _bytes_needed(state)
    staging = staging_folder(final)
    if grid.is_first_rank:
        final.parent.mkdir(parents=True, exist_ok=True)
    free = grid.gather_from_all(shutil.disk_usage(final.parent).free if grid.is_first_rank else None)[0]
    _refuse_full_disk(needed, free, final)
    if grid.is_first_rank:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    grid.barrier()
    return PreparedSave(staging, final, needed)


def finish_save(prepared: PreparedSave, state: EngineState, written: RankWrite, run: RunRecord | None) -> Path:
    """Steps 3-4 (every rank, together): the manifest and the rename once every rank's files are
    written, else the partial folder removed and the run stopped with one sentence."""
    grid, staging, final = state.grid, prepared.staging, prepared.final
    outcomes: list[RankWrite] = grid.gather_from_all(written)
    nonfinite = [(rank, outcome.nonfinite) for rank, outcome in enumerate(outcomes) if outcome.nonfinite]
    if nonfinite:
        _remove_staging(grid, staging)
        raise _nonfinite_error(*nonfinite[0], final)
    failed = [(rank, outcome.error) for rank, outcome in enumerate(outcomes) if outcome.error]
    if not failed:
        finish_error = None
        if grid.is_first_rank:
            files = {name: record for outcome in outcomes for name, record in outcome.records.items()}
            try:
                _finish(staging, final, state, files, run)
            except OSError as error:
                finish_error = error.strerror or str(error)
        failed = [(0, error) for error in grid.gather_from_all(finish_error)[:1] if error]
    if failed:
        _remove_staging(grid, staging)
        rank, reason = failed[0]
        full = os.strerror(errno.ENOSPC) in reason
        advice = (
            f"it needs about {prepared.needed:,} bytes: free space or point --save at a larger disk"
            if full
            else "check the --save disk"
        )
        raise CheckpointError(
            f"saving {final} failed on rank {rank} ({reason}); the partial folder was removed and "
            f"earlier checkpoints are intact; {advice}"
        )
    return final


def _remove_staging(grid: ParallelGrid, staging: Path) -> None:
    """A failed save's partial folder, gone on every rank's return (every rank, together)."""
    if grid.is_first_rank:
        shutil.rmtree(staging, ignore_errors=True)
    grid.barrier()


def save_folder(state: EngineState, final: Path, run: RunRecord | None) -> Path:
    """Write `state` (every rank's) as the checkpoint folder `final`, atomically (see the module doc)."""
    prepared = prepare_save(state, final)
    return finish_save(prepared, state, write_rank_files(prepared.staging, state), run)
