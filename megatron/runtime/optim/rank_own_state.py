"""The compressed optimizers' per-rank state in a checkpoint: each averaged buffer's worker and
server errors and any tensor the replicas hold apart (0/1 Adam between synchronisations), in the
rank's own `compression_rank*.safetensors` file with the rank's place in the grid and each buffer's
real element count as metadata.

A run on the same layout takes its own rank's tensors back: the resume is exact. A run at another
data-parallel size (tensor, pipeline and expert sizes unchanged, so each rank holds the same
parameters as the saved ranks at its place) re-splits them over its replica groups:

- a worker error, and a tensor the replicas held apart, becomes the mean of the saved replicas'
  (the mean is what the group's average still owed, or held);
- the server errors, one chunk per saved rank, are joined in rank order and cut again into this
  run's chunks, element by element.

Padding elements (the buffers are padded to a multiple of 8 x ranks) start at zero after a
re-split. Under another tensor, pipeline or expert layout the errors start at zero, as DeepSpeed's
always do."""

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
import torch.distributed as dist

from megatron.checkpoint.layout import COMPRESSION, rank_files
from megatron.checkpoint.save import RankOwnState
from megatron.checkpoint.tensors import open_tensors
from megatron.comm.onebit import ErrorFeedback, padded_numel
from megatron.parallel import ParallelGrid, is_parallel
from megatron.placement import expert_ids
from megatron.runtime.optim.compressed import CompressedOptimizer

FIXED_SIZES = ("tp_size", "pp_size", "ep_size", "expert_tp_size")
PLACE = (*FIXED_SIZES, "tp_rank", "pp_rank", "ep_rank", "expert_tp_rank", "dp_rank", "expert_dp_rank")


def place_of(grid: ParallelGrid) -> dict[str, int]:
    return {key: getattr(grid, key) for key in PLACE}


def rank_own_state(optimizer: CompressedOptimizer, names: dict[torch.Tensor, str]) -> RankOwnState | None:
    """This rank's error buffers and replica-local tensors under their parameters' names."""
    local = optimizer.replica_local()
    if not optimizer.errors and not local:
        return None
    tensors: dict[str, torch.Tensor] = {}
    for key, errors in optimizer.errors.items():
        tensors[f"worker/{names[key]}"], tensors[f"server/{names[key]}"] = errors.worker, errors.server
    for param, held in local.items():
        tensors.update({f"local/{state_key}/{names[param]}": value for state_key, value in held.items()})
    numels = {names[key]: optimizer.averaged_numel(key) for key in optimizer.errors}
    assert optimizer.grid is not None, "errors exist only where a grid has replica groups"
    metadata = {"place": json.dumps(place_of(optimizer.grid)), "numels": json.dumps(numels)}
    return RankOwnState(tensors, metadata)


@dataclass
class SavedRank:
    """One saving rank: its place, its buffers' real sizes and its files (parts of 256 MiB)."""

    place: dict[str, int]
    numels: dict[str, int]
    paths: list[Path]

    @cached_property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The rank's tensors, read once (they are about one copy of its parameters)."""
        tensors = {}
        for path in self.paths:
            with open_tensors(path) as handle:
                tensors.update({entry: handle.get_tensor(entry) for entry in handle.keys()})
        return tensors


def _saved_ranks(folder: Path) -> list[SavedRank]:
    saved: dict[str, SavedRank] = {}
    for path in rank_files(folder, COMPRESSION):
        with open_tensors(path) as handle:
            metadata = handle.metadata()
        rank = saved.setdefault(metadata["place"], SavedRank(json.loads(metadata["place"]), {}, []))
        rank.numels.update(json.loads(metadata["numels"]))
        rank.paths.append(path)
    return list(saved.values())


def _mean(values: list[torch.Tensor], numel: int, length: int) -> torch.Tensor:
    """The mean of the first `numel` elements of `values`, zero-padded to `length`."""
    out = torch.zeros(length, dtype=values[0].dtype)
    out[:numel] = torch.stack([v.reshape(-1)[:numel] for v in values]).mean(0)
    return out


def _rechunked(chunks: list[torch.Tensor], numel: int, length: int, ranks: int, position: int) -> torch.Tensor:
    """Chunk `position` of `ranks` of the first `numel` elements of `chunks` joined, zero-padded to `length`."""
    whole = torch.zeros(length, dtype=chunks[0].dtype)
    whole[:numel] = torch.cat(chunks)[:numel]
    return whole.view(ranks, -1)[position].clone()


def restore_rank_own_state(
    optimizer: CompressedOptimizer, names: dict[torch.Tensor, str], folder: Path, grid: ParallelGrid
) -> None:
    """Each buffer's errors and the replica-local tensors from `folder`, exactly on the saved layout
    and re-split at another data-parallel size (see the module doc)."""
    optimizer.errors.clear()
    saved = _saved_ranks(folder)
    if not saved:
        if not optimizer.reduces_gradients:
            optimizer.print_once(f"{folder} holds no error feedback: it starts at zero")
        return
    mine = place_of(grid)
    if any(saved[0].place[key] != mine[key] for key in FIXED_SIZES):
        sizes = lambda place: "/".join(str(place[key]) for key in FIXED_SIZES)  # noqa: E731
        optimizer.print_once(
            f"the error feedback in {folder} fits tp/pp/ep/expert-tp sizes {sizes(saved[0].place)}, not this run's "
            f"{sizes(mine)}: it starts at zero, as DeepSpeed's always does"
        )
        return
    local = optimizer.replica_local()
    resplit: set[tuple[int, int]] = set()
    for param, name in names.items():
        experts = expert_ids(param) is not None
        axis = "expert_dp_rank" if experts else "dp_rank"
        same = ("pp_rank", "ep_rank", "expert_tp_rank") if experts else ("pp_rank", "tp_rank")
        holders = sorted(
            (s for s in saved if all(s.place[key] == mine[key] for key in same)), key=lambda s: s.place[axis]
        )
        group = optimizer.replica_group(param)
        ranks = dist.get_world_size(group) if is_parallel(group) else 1
        position = mine[axis]
        exact = len(holders) == ranks
        if not exact and holders:
            resplit.add((len(holders), ranks))
        if holders and name in holders[0].numels and ranks > 1:
            numel = holders[0].numels[name]
            if exact:
                worker, server = (
                    holders[position].tensors[f"worker/{name}"],
                    holders[position].tensors[f"server/{name}"],
                )
            else:
                length = padded_numel(numel, ranks)
                worker = _mean([h.tensors[f"worker/{name}"] for h in holders], numel, length)
                server = _rechunked([h.tensors[f"server/{name}"] for h in holders], numel, length, ranks, position)
            device = param.device
            optimizer.errors[param] = ErrorFeedback(worker.to(device), server.to(device))
        for state_key, tensor in local.get(param, {}).items():
            entry = f"local/{state_key}/{name}"
            if holders and entry in holders[0].tensors:
                values = [holders[position].tensors[entry]] if exact else [h.tensors[entry] for h in holders]
                tensor.copy_(_mean(values, tensor.numel(), tensor.numel()).view_as(tensor))
    if resplit:
        sizes = ", ".join(f"{old} -> {new}" for old, new in sorted(resplit))
        optimizer.print_once(
            f"error feedback re-split for replica groups of another size ({sizes}): each worker error is the saved "
            "replicas' mean, the server errors are re-cut element by element"
        )
