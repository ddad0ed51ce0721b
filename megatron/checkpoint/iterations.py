"""Megatron's checkpoint directory: one folder per saved iteration and `latest`, which names the
one to resume from and moves only once that folder is complete and flushed.

On load the directory is put right first (what a crash left: a `.tmp` folder is removed, an
`.old` folder whose replacement never arrived is put back), then the iteration to resume from is
chosen: `--ckpt-step N`, else `latest`, else (missing or garbage `latest`) the newest folder that
verifies, with a log line saying so. A damaged checkpoint is refused with one sentence naming the
file and the newest intact older iteration to load instead, and one whose model differs from the
run's where it matters with one sentence naming the field (model_config.py).
"""

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from megatron.checkpoint.durable import write_text_durably
from megatron.checkpoint.layout import (
    ENGINE_FILE,
    LATEST_FILE,
    MANIFEST_FILE,
    MODEL,
    REPLACED_SUFFIX,
    STAGING_SUFFIX,
    iteration_tag,
    rank_files,
    tag_iteration,
)
from megatron.checkpoint.manifest import PRE_MANIFEST_FORMAT, Manifest, RunRecord
from megatron.checkpoint.model_config import check_model_config
from megatron.checkpoint.verify import DamagedCheckpoint, verify_folder
from megatron.errors import CheckpointError
from megatron.model.config import GPTConfig
from megatron.parallel import ParallelGrid

Log = Callable[[str], None]


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from: its folder's manifest read once, every file verified."""

    iteration: int
    folder: Path
    manifest: Manifest


class FolderSaver(Protocol):
    """What writes one iteration's folder (the runtime's engine): the checkpoint package only moves
    `latest` after it, so it needs no import of the runtime above it."""

    parallel: ParallelGrid

    def save_checkpoint(
        self, save_dir: str, tag: str, client_state: dict[str, Any] | None = None, run: RunRecord | None = None
    ) -> Path: ...


def save_checkpoint(engine: FolderSaver, save_dir: str, iteration: int, run: RunRecord) -> Path:
    """Save `save_dir/iter_N/` atomically, then move `latest` to it."""
    folder = engine.save_checkpoint(save_dir, iteration_tag(iteration), run=run)
    point_latest(save_dir, iteration, engine.parallel)
    return folder


def point_latest(save_dir: str, iteration: int, grid: ParallelGrid) -> None:
    """Move `latest` to iteration `iteration`, whose folder is complete (every rank, together)."""
    if grid.is_first_rank:
        write_text_durably(Path(save_dir) / LATEST_FILE, f"{iteration}\n")
    grid.barrier()


def read_latest(load_dir: str) -> tuple[int | None, str | None]:
    """The iteration `latest` names, or None and why it names none."""
    latest = Path(load_dir) / LATEST_FILE
    if not latest.is_file():
        return None, f"{latest} is missing"
    text = latest.read_bytes().decode(errors="replace").strip()
    if not text.isdigit():
        return None, f"{latest} holds {text[:40]!r} instead of an iteration number"
    return int(text), None


def saved_iterations(load_dir: str) -> list[int]:
    """Iterations whose folder was renamed into place (verify_folder says whether it is intact),
    newest first: a folder named iter_N that holds a manifest, a format-1 engine.json or weights."""
    folder = Path(load_dir)
    if not folder.is_dir():
        return []
    found = [
        tag_iteration(child.name)
        for child in folder.iterdir()
        if (child / MANIFEST_FILE).is_file() or (child / ENGINE_FILE).is_file() or rank_files(child, MODEL)
    ]
    return sorted((it for it in found if it is not None), reverse=True)


def holds_checkpoints(save_dir: str) -> bool:
    return bool(saved_iterations(save_dir)) or (Path(save_dir) / LATEST_FILE).is_file()


def repair_directory(load_dir: str, log: Log) -> None:
    """Undo what a crash during a save left behind (first rank only)."""
    folder = Path(load_dir)
    for child in sorted(folder.iterdir()):
        if child.name.endswith(REPLACED_SUFFIX) and tag_iteration(child.name.removesuffix(REPLACED_SUFFIX)) is not None:
            final = child.with_name(child.name.removesuffix(REPLACED_SUFFIX))
            if final.exists():
                shutil.rmtree(child)
                log(f" > removed {child}, left by a save of {final.name} that was interrupted after it finished")
            else:
                child.rename(final)
                log(f" > restored {final} from {child.name}: a save that was replacing it was interrupted")
    for child in sorted(folder.iterdir()):
        if child.name.endswith(STAGING_SUFFIX) and child.is_dir():
            shutil.rmtree(child)
            log(f" > removed {child}, a save that was interrupted before it finished")


def newest_intact(load_dir: str, grid: ParallelGrid, below: int | None = None) -> ResumePoint | None:
    """The newest iteration (older than `below`) whose folder verifies."""
    for iteration in saved_iterations(load_dir):
        if below is not None and iteration >= below:
            continue
        folder = Path(load_dir) / iteration_tag(iteration)
        try:
            return ResumePoint(iteration, folder, verify_folder(folder, grid))
        except CheckpointError:
            continue
    return None


def _refuse_damaged(load_dir: str, iteration: int, grid: ParallelGrid, error: DamagedCheckpoint) -> CheckpointError:
    older = newest_intact(load_dir, grid, below=iteration)
    instead = (
        f"load iteration {older.iteration} instead with --ckpt-step {older.iteration}"
        if older is not None
        else "no older intact checkpoint exists: start afresh in another --save folder"
    )
    return CheckpointError(f"checkpoint iteration {iteration} is damaged: {error}; {instead}")


def resume_point(
    load_dir: str,
    grid: ParallelGrid,
    ckpt_step: int | None,
    train_iters: int | None,
    log: Log,
    model: GPTConfig | None = None,
    weights_only: bool = False,
) -> ResumePoint | None:
    """The verified checkpoint to resume from, or None to start from scratch; `train_iters` (None:
    no limit) is where the run ends. With `model` (the run's, its vocabulary padded) the
    checkpoint's model is compared with it first, `weights_only` for a run that loads the weights
    alone (--reset-iteration). Every rank calls it."""
    point = _verified(load_dir, grid, ckpt_step, log)
    if point is None:
        return None
    _within(point.iteration, train_iters, load_dir)
    if model is not None:
        check_model_config(point.folder, point.manifest, model, weights_only, log)
    return point


def _verified(load_dir: str, grid: ParallelGrid, ckpt_step: int | None, log: Log) -> ResumePoint | None:
    if not Path(load_dir).is_dir():
        if ckpt_step is not None:
            raise CheckpointError(
                f"--load {load_dir} does not exist, so --ckpt-step {ckpt_step} cannot be loaded; check --load"
            )
        log(
            f" > WARNING: --load {load_dir} does not exist yet, so training starts from scratch at iteration 0 "
            "(as on the first run of a --save X --load X job)"
        )
        return None
    if grid.is_first_rank:
        repair_directory(load_dir, log)
    grid.barrier()
    if ckpt_step is not None:
        iteration = ckpt_step
        if iteration not in saved_iterations(load_dir):
            have = ", ".join(map(str, saved_iterations(load_dir))) or "none"
            raise CheckpointError(
                f"--ckpt-step {ckpt_step}: {load_dir} holds no complete checkpoint of that iteration "
                f"(it has: {have}); pick one of those"
            )
    else:
        iteration, problem = read_latest(load_dir)
        if iteration is None and not saved_iterations(load_dir):
            log(f" > WARNING: --load {load_dir} holds no checkpoint, so training starts from scratch at iteration 0")
            return None
        if iteration is None or iteration not in saved_iterations(load_dir):
            problem = (
                problem or f"{Path(load_dir) / LATEST_FILE} names iteration {iteration}, which has no complete folder"
            )
            point = newest_intact(load_dir, grid)
            if point is None:
                raise CheckpointError(
                    f"{problem} and no checkpoint folder in {load_dir} is intact; start afresh in another --save folder"
                )
            log(f" > {problem}: resuming from the newest intact checkpoint, iteration {point.iteration}")
            return point
    folder = Path(load_dir) / iteration_tag(iteration)
    try:
        manifest = verify_folder(folder, grid)
    except DamagedCheckpoint as error:
        raise _refuse_damaged(load_dir, iteration, grid, error) from None
    if manifest.format_version == PRE_MANIFEST_FORMAT:
        log(f" > {folder} has no {MANIFEST_FILE} (saved by an earlier version): loading it without verifying its files")
    return ResumePoint(iteration, folder, manifest)


def _within(iteration: int, train_iters: int | None, load_dir: str) -> None:
    if train_iters is not None and iteration > train_iters:
        raise CheckpointError(
            f"the checkpoint to resume in {load_dir} is at iteration {iteration}, beyond --train-iters {train_iters}; "
            "raise the training length or pick an earlier checkpoint with --ckpt-step"
        )
