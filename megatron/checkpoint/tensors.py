"""Engine state <-> safetensors files and JSON, nothing pickled.

Tensors are saved under global names, so a checkpoint loads under another data- or
expert-parallel layout: a parameter whose placement has expert ids (dim 0 holds those experts)
is stored as one entry per expert, `name[g]`; optimizer state is keyed `state_key/param_name`
the same way. Each rank writes the entries it owns to `{stem}_rank{R}.safetensors`, and a reader
finds any entry in any of those files. Under ZeRO an optimizer-state entry covers only the
elements a rank owns, `state_key/param_name@start:stop` over the flattened tensor; the reader
joins such pieces back into the whole tensor.
"""

import json
import random
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from megatron.checkpoint.layout import rank_files
from megatron.checkpoint.manifest import FileRecord
from megatron.checkpoint.tensor_file import Opener, planned_of, write_tensor_file
from megatron.errors import CheckpointError
from megatron.placement import expert_ids, local_part, tensor_parallel_split
from megatron.tensor_split import TP_SLICE_MARK, unshard

SLICE_ENTRY = re.compile(rf"(?P<name>.+){TP_SLICE_MARK}0of(?P<count>\d+)")
EXPERT_ENTRY = re.compile(r"(?P<name>.+)\[\d+\]")  # one expert of a stacked tensor
# a tensor-parallel tensor's split as the manifest records it: name -> (dim, partition sizes or None)
SplitTable = dict[str, tuple[int, tuple[int, ...] | None]]


Item = TypeVar("Item")


def pack_by_size(items: list[Item], nbytes: Callable[[Item], int], max_bytes: int) -> list[list[Item]]:
    """Items in their order, cut into files of at most `max_bytes` of data (a larger item gets a
    file of its own)."""
    files: list[list[Item]] = []
    size = 0
    for item in items:
        if not files or size + nbytes(item) > max_bytes:
            files.append([])
            size = 0
        files[-1].append(item)
        size += nbytes(item)
    return files


def global_entries(name: str, tensor: torch.Tensor, ids: tuple[int, ...] | None) -> dict[str, torch.Tensor]:
    """A tensor under its global names: one entry per expert for an expert-parallel tensor."""
    if ids is None or tensor.dim() == 0:
        return {name: tensor}
    return {f"{name}[{g}]": tensor[i] for i, g in enumerate(ids)}


@contextmanager
def open_tensors(path: Path) -> Iterator[Any]:
    """A safetensors file opened for reading; a damaged one is a CheckpointError naming it."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            yield handle
    except SafetensorError as error:
        raise CheckpointError(f"{path} is damaged ({error}); load an earlier checkpoint") from None


class ShardedReader:
    """Reads entries by name from every `{stem}_rank*.safetensors` file of a checkpoint folder."""

    def __init__(self, folder: Path, stem: str, splits: SplitTable | None = None) -> None:
        """`splits`: how the saving run split its tensor-parallel tensors, for entries it saved as
        slices (`name~tp{r}of{n}`)."""
        self.splits = splits or {}
        self.files = rank_files(folder, stem)
        if not self.files:
            raise CheckpointError(
                f"no {stem}_rank*.safetensors in {folder}; the checkpoint is incomplete, load an earlier one"
            )
        self.file_of: dict[str, Path] = {}
        for path in self.files:
            with open_tensors(path) as handle:
                self.file_of.update(dict.fromkeys(handle.keys(), path))
        self.pieces: dict[str, list[tuple[int, int, str]]] = {}
        for key in self.file_of:
            whole, at, span = key.partition("@")
            if at:
                start, stop = span.split(":")
                self.pieces.setdefault(whole, []).append((int(start), int(stop), key))
        # how many tensor-parallel slices each entry saved as slices has: "name~tp0of2" -> name: 2
        self.slice_counts: dict[str, int] = {}
        for key in (*self.file_of, *self.pieces):
            if match := SLICE_ENTRY.fullmatch(key):
                self.slice_counts[match["name"]] = int(match["count"])

    def has(self, key: str) -> bool:
        return key in self.file_of or key in self.pieces

    def _read(self, key: str) -> torch.Tensor:
        with open_tensors(self.file_of[key]) as handle:
            return handle.get_tensor(key)

    def get(self, key: str, shape: torch.Size | None = None) -> torch.Tensor:
        """An entry by name; one saved in pieces is joined (and given `shape` if known)."""
        if key in self.file_of:
            return self._read(key)
        if key not in self.pieces:
            raise CheckpointError(
                f"{key} is not in the checkpoint {self.files[0].parent}; use the model flags (layers, "
                "expert counts) of the run that saved it"
            )
        parts, covered = [], 0
        for start, stop, piece in sorted(self.pieces[key]):
            if start != covered:
                raise CheckpointError(
                    f"{key} lacks elements {covered}:{start} in {self.files[0].parent}; "
                    "a rank's optimizer file is missing, load an earlier checkpoint"
                )
            parts.append(self._read(piece))
            covered = stop
        flat = torch.cat(parts)
        return flat if shape is None else flat.reshape(shape)

    def get_whole(self, name: str, shape: torch.Size) -> torch.Tensor:
        """Entry `name` as TP=1 holds it (`shape`), saved whole or as tensor-parallel slices."""
        if self.has(name):
            return self.get(name, shape)
        count, split = self.slice_counts.get(name), self._split_of(name.split("/", 1)[-1])
        if count is None or split is None:
            return self.get(name, shape)  # the error that names the missing entry
        dim, parts = split
        slice_shape = list(shape)
        slice_shape[dim] //= count
        return unshard(
            [self.get(f"{name}{TP_SLICE_MARK}{r}of{count}", torch.Size(slice_shape)) for r in range(count)], dim, parts
        )

    def _split_of(self, base: str) -> tuple[int, tuple[int, ...] | None] | None:
        """How the saving run split tensor `base`, or one expert `base` of a stacked tensor (one dim less)."""
        if base in self.splits:
            return self.splits[base]
        if (expert := EXPERT_ENTRY.fullmatch(base)) and expert["name"] in self.splits:
            dim, parts = self.splits[expert["name"]]
            return dim - 1, parts
        return None

    def get_like(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Entry `name` in the layout `tensor` has on this rank (whole, or its tensor-parallel slice),
        whatever layout the checkpoint was saved in."""
        split = tensor_parallel_split(tensor)
        if split is None:
            return self.get_whole(name, tensor.shape)
        if self.has(own := split.entry_name(name)):  # saved under this very layout
            return self.get(own, tensor.shape)
        return split.slice_of(self.get_whole(name, split.whole_shape(tensor.shape)))

    def get_global(self, name: str, ids: tuple[int, ...] | None, shape: torch.Size | None = None) -> torch.Tensor:
        """Entry `name` whole; with expert `ids`, those experts' entries stacked (each joined from
        tensor-parallel slices if saved so, which needs the whole `shape`)."""
        if ids is None or self.has(name):
            return self.get(name, shape)
        if shape is None:
            return torch.stack([self.get(f"{name}[{g}]") for g in ids])
        return torch.stack([self.get_whole(f"{name}[{g}]", shape[1:]) for g in ids])


def save_tensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None, opener: Opener | None = None
) -> FileRecord:
    """`tensors` as the safetensors file `path` (not yet flushed), and its record; `opener` writes
    it (default: buffered writes)."""
    return write_tensor_file(path, planned_of(tensors), tensors.__getitem__, metadata, opener)


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as TP=1 holds it: a tensor-parallel slice is gathered from its group (a collective
    every rank of the group takes part in)."""
    split = tensor_parallel_split(tensor)
    return tensor.detach() if split is None else split.whole_of(tensor.detach())


def tensor_parallel_splits(module: torch.nn.Module) -> SplitTable:
    """How the module's tensor-parallel parameters are split, by name, for the manifest."""
    return {
        name: (split.dim, split.partition_sizes)
        for name, param in module.named_parameters()
        if (split := tensor_parallel_split(param)) is not None
    }


def model_entries(module: torch.nn.Module, owns_dense: bool, owns_experts: bool) -> dict[str, torch.Tensor]:
    """Every tensor whole under its global name (experts one entry each), of the classes this rank owns."""
    entries: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        ids = expert_ids(tensor)
        value = whole_tensor(tensor)
        if owns_experts if ids else owns_dense:
            entries.update(global_entries(name, value, ids))
    return entries


def load_model_entries(module: torch.nn.Module, reader: ShardedReader) -> None:
    own = module.state_dict(keep_vars=True)
    loaded = {}
    for name, tensor in own.items():
        value = reader.get_global(name, expert_ids(tensor))
        split = tensor_parallel_split(tensor)
        expected = tensor.shape if split is None else split.whole_shape(tensor.shape)
        if value.shape != expected:
            raise CheckpointError(
                f"parameter {name} in {reader.files[0].parent} has shape {tuple(value.shape)} but this model's "
                f"is {tuple(expected)}; use the same model flags as the run that saved it"
            )
        loaded[name] = local_part(tensor, value)
    module.load_state_dict(loaded)


def optimizer_entries(
    optimizer: torch.optim.Optimizer, names: dict[torch.nn.Parameter, str], owns_dense: bool, owns_experts: bool
) -> dict[str, torch.Tensor]:
    """Optimizer state as global entries `state_key/param_name[...]`, whole."""
    entries: dict[str, torch.Tensor] = {}
    for param, state in optimizer.state.items():
        ids = expert_ids(param)
        split = tensor_parallel_split(param)
        for key, value in state.items():
            if not torch.is_tensor(value):
                raise CheckpointError(f"optimizer state {key!r} is not a tensor; this optimizer cannot be checkpointed")
            if split is not None and value.dim() > 0:  # every tensor-parallel rank gathers; the owner keeps
                value = split.whole_of(value)
            if owns_experts if ids else owns_dense:
                entries.update(global_entries(f"{key}/{names[param]}", value, ids))
    return entries


def _plain(value: Any) -> Any:
    """A group setting as JSON holds it: a tensor lr (torch and DeepSpeed allow one) as its number."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (tuple, list)):
        return type(value)(_plain(item) for item in value)
    return value


def _like(current: Any, saved: Any) -> Any:
    """A saved setting in the form this run's group holds it: a tensor stays a tensor of its dtype."""
    if isinstance(current, torch.Tensor):
        return torch.tensor(saved, dtype=current.dtype, device=current.device)
    if isinstance(current, (tuple, list)) and isinstance(saved, (tuple, list)) and len(current) == len(saved):
        return type(current)(_like(c, s) for c, s in zip(current, saved))
    return saved


def optimizer_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's settings (lr, betas, weight decay, ...) without its tensors."""
    return [{k: _plain(v) for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def load_optimizer_entries(
    optimizer: torch.optim.Optimizer,
    names: dict[torch.nn.Parameter, str],
    reader: ShardedReader,
    saved_groups: list[dict[str, Any]],
) -> None:
    """Each parameter's state, whether saved whole or in ZeRO pieces."""
    state_keys = optimizer_state_keys(reader)
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def value(key: str, param: torch.nn.Parameter) -> torch.Tensor:
        name, split, ids = f"{key}/{names[param]}", tensor_parallel_split(param), expert_ids(param)
        if split is not None and not ids and not reader.has(name):  # saved as tensor-parallel slices
            return reader.get_like(name, param)
        shape = param.shape if split is None else split.whole_shape(param.shape)
        whole = reader.get_global(name, ids, shape) if ids else reader.get_whole(name, shape)
        return whole if split is None or whole.dim() == 0 else split.slice_of(whole)

    state = {
        index: {key: value(key, p) for key in state_keys[names[p]]}
        for index, p in enumerate(params)
        if names[p] in state_keys
    }
    load_optimizer_state(optimizer, state, saved_groups)


def optimizer_state_keys(reader: ShardedReader) -> dict[str, set[str]]:
    """The state keys (exp_avg, step, ...) saved for each parameter name."""
    state_keys: dict[str, set[str]] = {}
    for entry in reader.file_of:
        key, name = entry.split("/", 1)
        state_keys.setdefault(re.split(r"[\[@~]", name, maxsplit=1)[0], set()).add(key)
    return state_keys


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, state: dict[int, dict[str, torch.Tensor]], saved_groups: list[dict[str, Any]]
) -> None:
    """Load through torch's own state-dict form, so torch puts each value on the device and dtype
    its optimizer implementation expects."""
    current = optimizer.state_dict()
    if len(saved_groups) != len(current["param_groups"]):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(saved_groups)} parameter groups but this run has "
            f"{len(current['param_groups'])}; load with --no-load-optim to start a fresh optimizer"
        )
    groups = [
        {**{key: _like(group.get(key), value) for key, value in saved.items()}, "params": group["params"]}
        for saved, group in zip(saved_groups, current["param_groups"])
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


@dataclass(frozen=True)
class RngState:
    """Every generator's state, as the rng file holds it: torch's as tensors, Python's and numpy's
    as JSON metadata."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]


def rng_state() -> RngState:
    """The generators' state now (a save in the background writes what they were at the save)."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["torch_cuda"] = torch.cuda.get_rng_state()
    np_state = np.random.get_state()
    metadata = {
        "python": json.dumps(random.getstate()),
        "numpy": json.dumps([np_state[0], np_state[1].tolist(), *np_state[2:]]),
    }
    return RngState(tensors, metadata)


def load_rng_state(path: Path) -> None:
    with open_tensors(path) as handle:
        metadata = handle.metadata()
        torch.set_rng_state(handle.get_tensor("torch_cpu"))
        if torch.cuda.is_available() and "torch_cuda" in handle.keys():
            torch.cuda.set_rng_state(handle.get_tensor("torch_cuda"))
    version, state, gauss = json.loads(metadata["python"])
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = json.loads(metadata["numpy"])
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
