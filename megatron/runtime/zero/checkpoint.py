"""ZeRO optimizer state <-> checkpoint entries in the global layout.

Each rank writes the elements of each parameter's state that its shards own, as
`state_key/param_name@start:stop` over the flattened parameter (experts per global id,
`param_name[g]@start:stop`); scalar state such as Adam's step is written whole as `state_key/param_name`,
as without ZeRO. A tensor-parallel slice is a tensor of its own, `name~tp{r}of{n}`. Loading joins
every parameter's pieces (or takes its whole entry from a run without ZeRO, or joins a saved
tensor-parallel size's slices) and cuts this rank's slices out of them, so the data-parallel and
tensor-parallel sizes and the stage may change between save and load.
"""

from typing import Any

import torch

from megatron.checkpoint.tensors import ShardedReader, load_optimizer_state, optimizer_state_keys
from megatron.runtime.zero.layout import PartitionLayout, Unit, parameter_units


def partition_state_entries(
    optimizer: torch.optim.Optimizer, partitions: list[PartitionLayout]
) -> dict[str, torch.Tensor]:
    entries: dict[str, torch.Tensor] = {}
    for part in partitions:
        # an optimizer that keeps state elsewhere (swap files) hands it over whole
        state = (
            optimizer.full_state(part.shard)
            if hasattr(optimizer, "full_state")
            else optimizer.state.get(part.shard, {})
        )
        for key, value in state.items():
            if value.dim() == 0:
                entries.update({f"{key}/{name}": value.clone() for name in part.names})
                continue
            for piece in part.pieces():
                owned = value[piece.shard_start : piece.shard_start + piece.stop - piece.start]
                entries[f"{key}/{piece.name}@{piece.start}:{piece.stop}"] = owned.clone()
    return entries


def load_partition_state(
    optimizer: torch.optim.Optimizer,
    partitions: list[PartitionLayout],
    reader: ShardedReader,
    saved_groups: list[dict[str, Any]],
) -> None:
    state_keys = optimizer_state_keys(reader)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for index, part in enumerate(partitions):  # the shards' order in the optimizer's groups
        units = {
            unit.name: unit for name, param in zip(part.names, part.params) for unit in parameter_units(name, param)
        }
        for key in sorted(state_keys.get(part.names[0], ())):
            state.setdefault(index, {})[key] = _shard_value(reader, part, units, key)
    load_optimizer_state(optimizer, state, saved_groups)


def _shard_value(reader: ShardedReader, part: PartitionLayout, units: dict[str, Unit], key: str) -> torch.Tensor:
    whole = f"{key}/{part.names[0]}"
    if whole in reader.file_of and (scalar := reader.get(whole)).dim() == 0:  # Adam's step
        return scalar
    value = torch.zeros_like(part.shard)  # the padding past the last parameter stays zero
    read: dict[str, torch.Tensor] = {}
    for piece in part.pieces():
        if piece.name not in read:
            read[piece.name] = _flat_entry(reader, units[piece.name], key)
        flat = read[piece.name]
        value[piece.shard_start : piece.shard_start + piece.stop - piece.start] = flat[piece.start : piece.stop]
    return value


def _flat_entry(reader: ShardedReader, unit: Unit, key: str) -> torch.Tensor:
    """The state of one unit of the partition (a tensor, one expert, or this rank's tensor-parallel
    slice of either) flattened, from a checkpoint saved under this layout or any other tensor-parallel size."""
    if reader.has(f"{key}/{unit.name}"):
        return reader.get(f"{key}/{unit.name}").reshape(-1)
    if unit.split is None:
        return reader.get_whole(f"{key}/{unit.whole_name}", unit.shape).reshape(-1)
    return unit.split.slice_of(
        reader.get_whole(f"{key}/{unit.whole_name}", unit.split.whole_shape(unit.shape))
    ).reshape(-1)
