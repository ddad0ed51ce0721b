"""Our side of a conversion: the tensors a model config calls for, and a weights-only checkpoint
written tensor by tensor with the same layout, manifest and crash safety as a training save.

The checkpoint is `SAVE/iter_0000000/` with `latest` naming it: model_rank00000*.safetensors
(experts one entry per global expert id, so any expert-parallel size loads it) and the manifest
with the run record (model config and tokenizer, as a training run's, so load_model and
tools/generate.py read it) and every file's size and checksum. It has no
optimizer or RNG state: training continues from it with `--load SAVE` (the optimizer starts afresh; or
`--reset-iteration`), under any ZeRO stage and expert-parallel size. The importer writes it into
the staging folder of new_folder.py, renamed into place whole, so it needs no staging of its own.
"""

from collections.abc import Callable
from pathlib import Path

import torch

from megatron.checkpoint.durable import fsync_path, write_text_durably
from megatron.checkpoint.layout import LATEST_FILE, MODEL, iteration_tag, rank_file
from megatron.checkpoint.manifest import (
    FORMAT_VERSION,
    EngineRecord,
    FileRecord,
    LayoutRecord,
    Manifest,
    RunRecord,
    write_manifest,
)
from megatron.checkpoint.save import PART_BYTES
from megatron.checkpoint.tensor_file import Planned, TensorInfo, write_tensor_file
from megatron.checkpoint.tensors import global_entries, pack_by_size
from megatron.errors import CheckpointError
from megatron.hf.new_folder import FILE_ALLOWANCE
from megatron.model import GPTConfig, GPTModel
from megatron.placement import expert_ids


def expected_entries(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every entry (name and shape) a checkpoint of model `config` holds, from the model built on
    the meta device (no memory), experts one entry per global id."""
    with torch.device("meta"):
        model = GPTModel(config)
    entries: dict[str, tuple[int, ...]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        entries.update(
            {key: tuple(value.shape) for key, value in global_entries(name, tensor, expert_ids(tensor)).items()}
        )
    return entries


def check_entries(found: dict[str, TensorInfo], expected: dict[str, tuple[int, ...]], where: str, fix: str) -> None:
    """Refuse (naming the first) a missing entry or one of another shape."""
    for name, shape in expected.items():
        if name not in found:
            raise CheckpointError(f"{where} lacks {name}; {fix}")
        if found[name].shape != shape:
            raise CheckpointError(
                f"{name} in {where} has shape {found[name].shape} but the model config calls for {shape}; {fix}"
            )


def checkpoint_bytes(planned: list[Planned]) -> int:
    """About as many bytes as `write_weights_checkpoint` writes, generously: the tensors, a header
    entry for each, the manifest and `latest`."""
    parts = len(pack_by_size(planned, lambda entry: entry.info.nbytes, PART_BYTES))
    return sum(entry.info.nbytes for entry in planned) + 256 * len(planned) + FILE_ALLOWANCE * (parts + 3)


# an engine that has taken no step: the optimizer, LR schedule and loss scale of a run loading it start afresh
WEIGHTS_ONLY = EngineRecord(
    global_steps=0,
    micro_steps=0,
    skipped_steps=0,
    optimizer_groups=[],
    lr_scheduler=None,
    loss_scaler=None,
    weights_only=True,
)


def write_weights_checkpoint(
    save: Path,
    planned: list[Planned],
    produce: Callable[[str], torch.Tensor],
    run: RunRecord,
    ep_size: int,
) -> Path:
    """Write `SAVE/iter_0000000/` into the new, empty folder `save` and point `latest` at it."""
    folder = save / iteration_tag(0)
    folder.mkdir()
    files: dict[str, FileRecord] = {}
    for part, entries in enumerate(pack_by_size(planned, lambda entry: entry.info.nbytes, PART_BYTES)):
        name = rank_file(MODEL, 0, part)
        files[name] = write_tensor_file(folder / name, entries, produce)
        fsync_path(folder / name)
    write_manifest(
        folder,
        Manifest(
            format_version=FORMAT_VERSION,
            run=run,
            layout=LayoutRecord(
                world_size=1,
                tensor_parallel_size=1,
                pipeline_parallel_size=1,
                data_parallel_size=1,
                expert_parallel_size=ep_size,
                expert_tensor_parallel_size=1,
            ),
            engine=WEIGHTS_ONLY,
            zero_stage=0,
            precision="fp32",
            files=dict(sorted(files.items())),
        ),
    )
    fsync_path(folder)
    write_text_durably(save / LATEST_FILE, "0\n")
    return folder
