"""An engine's share of a checkpoint and its restore: the model and optimizer entries this rank
owns under their global names, the counters, LR schedule and loss scale for the manifest, and
DeepSpeed's consolidated 16-bit weights. The engine's save_checkpoint, load_checkpoint and
save_16bit_model call these."""

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron.checkpoint.layout import MODEL, OPTIMIZER, RNG, rank_file
from megatron.checkpoint.manifest import EngineRecord
from megatron.checkpoint.save import EngineState
from megatron.checkpoint.tensors import (
    ShardedReader,
    load_model_entries,
    load_rng_state,
    model_entries,
    optimizer_groups,
    save_tensors,
    tensor_parallel_splits,
)
from megatron.errors import ConfigError
from megatron.runtime.optim.compressed import CompressedOptimizer
from megatron.runtime.optim.rank_own_state import rank_own_state, restore_rank_own_state
from megatron.runtime.schedule_resume import restore_schedule

if TYPE_CHECKING:
    from megatron.runtime.engine import Engine


def checkpoint_state(engine: "Engine", client_state: dict[str, Any] | None = None) -> EngineState:
    """This rank's share of a checkpoint: the model and optimizer entries it owns under their
    global names, and (first rank) the counters, schedule and loss scale for the manifest."""
    grid = engine.parallel
    # each pipeline stage's first rank writes the stage's dense tensors (whole, gathered over tp)
    owns = grid.checkpoint_owners()
    splits = (
        {
            name: split
            for piece in grid.gather_from_all(tensor_parallel_splits(engine.module))
            for name, split in piece.items()
        }
        if grid.pp_size > 1
        else tensor_parallel_splits(engine.module)
    )
    with engine.whole_parameters():
        model = model_entries(engine.module, **owns)
    optim, optim_groups = engine.strategy.optimizer_state(**owns), optimizer_groups(engine.optimizer)
    record = (
        EngineRecord(
            global_steps=engine.global_steps,
            micro_steps=engine.micro_steps,
            skipped_steps=engine.skipped_steps,
            optimizer_groups=optim_groups,
            lr_scheduler=engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            loss_scaler=engine.loss_scaler.state_dict(),
            tensor_parallel_splits=splits,
            client_state=client_state or {},
        )
        if grid.is_first_rank
        else None
    )
    optimizer = engine.optimizer
    own = rank_own_state(optimizer, _names(engine)) if isinstance(optimizer, CompressedOptimizer) else None
    opener = engine.checkpoint_writer.open if engine.checkpoint_writer is not None else None
    return EngineState(model, optim, record, grid, engine.strategy.stage, engine.precision, own, opener=opener)


def _names(engine: "Engine") -> dict[torch.Tensor, str]:
    return {param: name for name, param in engine.module.named_parameters()}


def save_16bit_model(engine: "Engine", save_dir: str | Path, save_filename: str = "model.safetensors") -> bool:
    """DeepSpeed's consolidated weights: every parameter whole, in the training precision (bf16
    or fp16; fp32 without either), experts by global id, in one safetensors file written by
    the first rank. Under ZeRO-3 only with stage3_gather_16bit_weights_on_model_save, as in
    DeepSpeed: without it nothing is written and the answer is False."""
    if not save_filename.endswith(".safetensors"):
        raise ConfigError(
            f"save_16bit_model writes safetensors (nothing here is pickled); name the file "
            f"{Path(save_filename).stem}.safetensors instead of {save_filename}"
        )
    grid, path = engine.parallel, Path(save_dir) / save_filename
    if engine.strategy.stage == 3 and not engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
        if grid.is_first_rank:
            print(
                f" > did not save {path}: ZeRO-3 holds partitions and "
                "zero_optimization.stage3_gather_16bit_weights_on_model_save is false",
                flush=True,
            )
        return False
    dtype = engine.autocast_dtype or torch.float32
    with engine.whole_parameters():
        owned = model_entries(engine.module, **grid.checkpoint_owners())
        owned = {name: t.to(dtype, copy=True) if t.is_floating_point() else t.clone() for name, t in owned.items()}
    pieces = [owned]
    if grid.world_size > 1:
        pieces = [{}] * grid.world_size if grid.is_first_rank else None
        dist.gather_object(owned, pieces, dst=0)
    if grid.is_first_rank:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")  # a crash leaves no half-written weights
        save_tensors(partial, {name: t for piece in pieces for name, t in piece.items()})
        partial.replace(path)
    return True


def _same_setting(a: Any, b: Any) -> bool:
    """Equal as settings: a tuple equals the list JSON gives back, floats up to round-off."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_setting(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12)
    return a == b


def ignored_settings(given: list[dict[str, Any]], loaded: list[dict[str, Any]], scheduled: set[str]) -> str:
    """The settings this run gave its optimizer that the checkpoint's replaced, for one log line
    ("" when none): "weight_decay 0.05 (checkpoint: 0.1)"."""
    changes = [
        f"{key} {mine[key]} (checkpoint: {theirs[key]})"
        for mine, theirs in zip(given, loaded)
        for key in sorted(set(mine) & set(theirs) - scheduled)
        if not _same_setting(mine[key], theirs[key])
    ]
    return ", ".join(dict.fromkeys(changes))  # once per setting that differs alike in several groups


def _scheduled_keys(lr_scheduler: Any) -> set[str]:
    """Group settings the LR schedule sets itself (after a resume too)."""
    keys = {"lr", "initial_lr"}
    get_mom = getattr(lr_scheduler, "get_mom", None)
    if get_mom is not None and get_mom() is not None:
        keys.add("betas")
    return keys


def restore(engine: "Engine", folder: Path, saved: EngineRecord, load_optimizer: bool, load_rng: bool) -> None:
    with engine.whole_parameters():
        load_model_entries(engine.module, ShardedReader(folder, MODEL))
        engine.strategy.copy_from_parameters()
    if load_optimizer and saved.weights_only:  # e.g. imported from Hugging Face
        load_optimizer = False
        if engine.parallel.is_first_rank:
            print(
                f" > {folder} holds weights only: the optimizer, loss scale and LR schedule start afresh",
                flush=True,
            )
    if load_optimizer:
        reader = ShardedReader(folder, OPTIMIZER, saved.tensor_parallel_splits)
        given = optimizer_groups(engine.optimizer)
        engine.strategy.load_optimizer_state(reader, saved.optimizer_groups)
        if engine.lr_scheduler is not None and saved.lr_scheduler is not None:
            # the schedule steps once per optimizer step that was not skipped
            steps_taken = saved.global_steps - saved.skipped_steps
            changed = restore_schedule(engine.lr_scheduler, saved.lr_scheduler, steps_taken)
            if changed and engine.parallel.is_first_rank:
                print(changed, flush=True)
        ignored = ignored_settings(given, optimizer_groups(engine.optimizer), _scheduled_keys(engine.lr_scheduler))
        if ignored and engine.parallel.is_first_rank:
            print(
                f" > resuming: this run's optimizer {ignored} is ignored: the checkpoint's optimizer state "
                "keeps its own, as in DeepSpeed and Megatron; load with --no-load-optim (load_optimizer=False) "
                "to start the optimizer afresh with the new settings",
                flush=True,
            )
        if isinstance(engine.optimizer, CompressedOptimizer):
            restore_rank_own_state(engine.optimizer, _names(engine), folder, engine.parallel)
        engine.loss_scaler.load_state_dict(saved.loss_scaler)
        # count micro-batches in this run's accumulation: another data-parallel size changes it
        engine.global_steps = saved.global_steps
        engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps
        engine.skipped_steps = saved.skipped_steps
    rng_path = folder / rank_file(RNG, engine.parallel.rank)
    if load_rng and rng_path.is_file():
        load_rng_state(rng_path)
    elif load_rng and engine.parallel.is_first_rank:
        print(
            f" > {folder} has no RNG state for rank {engine.parallel.rank} (saved with another world size): "
            "random streams start afresh",
            flush=True,
        )
