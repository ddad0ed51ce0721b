"""Engine state <-> safetensors files and JSON, nothing pickled.

Tensors are saved under global names, so a checkpoint loads under another data- or
expert-parallel layout: a parameter that carries `expert_global_ids` (dim 0 holds those experts)
is stored as one entry per expert, `name[g]`; optimizer state is keyed `state_key/param_name`
the same way. Each rank writes the entries it owns to `{stem}_rank{R}.safetensors`, and a reader
finds any entry in any of those files.
"""

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron.errors import CheckpointError


def expert_ids(tensor: torch.Tensor) -> tuple[int, ...] | None:
    return getattr(tensor, "expert_global_ids", None)


def global_entries(name: str, tensor: torch.Tensor, ids: tuple[int, ...] | None) -> dict[str, torch.Tensor]:
    """A tensor under its global names: one entry per expert for an expert-parallel tensor."""
    if ids is None or tensor.dim() == 0:
        return {name: tensor}
    return {f"{name}[{g}]": tensor[i] for i, g in enumerate(ids)}


class ShardedReader:
    """Reads entries by name from every `{stem}_rank*.safetensors` file of a checkpoint folder."""

    def __init__(self, folder: Path, stem: str) -> None:
        self.files = sorted(folder.glob(f"{stem}_rank*.safetensors"))
        if not self.files:
            raise CheckpointError(f"no {stem}_rank*.safetensors in {folder}; the checkpoint is incomplete, load an earlier one")
        self.file_of: dict[str, Path] = {}
        for path in self.files:
            with safe_open(str(path), framework="pt") as handle:
                self.file_of.update(dict.fromkeys(handle.keys(), path))

    def get(self, key: str) -> torch.Tensor:
        if key not in self.file_of:
            raise CheckpointError(
                f"{key} is not in the checkpoint {self.files[0].parent}; use the model flags (layers, "
                "expert counts) of the run that saved it"
            )
        with safe_open(str(self.file_of[key]), framework="pt") as handle:
            return handle.get_tensor(key)

    def get_global(self, name: str, ids: tuple[int, ...] | None) -> torch.Tensor:
        if ids is None or name in self.file_of:
            return self.get(name)
        return torch.stack([self.get(f"{name}[{g}]") for g in ids])


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path), metadata=metadata)


def model_entries(module: torch.nn.Module, owns_dense: bool, owns_experts: bool) -> dict[str, torch.Tensor]:
    entries: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        ids = expert_ids(tensor)
        if owns_experts if ids else owns_dense:
            entries.update(global_entries(name, tensor.detach(), ids))
    return entries


def load_model_entries(module: torch.nn.Module, reader: ShardedReader) -> None:
    own = module.state_dict(keep_vars=True)
    loaded = {}
    for name, tensor in own.items():
        value = reader.get_global(name, expert_ids(tensor))
        if value.shape != tensor.shape:
            raise CheckpointError(
                f"parameter {name} in {reader.files[0].parent} has shape {tuple(value.shape)} but this model's "
                f"is {tuple(tensor.shape)}; use the same model flags as the run that saved it"
            )
        loaded[name] = value
    module.load_state_dict(loaded)


def optimizer_entries(
    optimizer: torch.optim.Optimizer, names: dict[torch.nn.Parameter, str], owns_dense: bool, owns_experts: bool
) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Optimizer state as global entries `state_key/param_name[...]`, and the group settings."""
    entries: dict[str, torch.Tensor] = {}
    for param, state in optimizer.state.items():
        ids = expert_ids(param)
        if not (owns_experts if ids else owns_dense):
            continue
        for key, value in state.items():
            if not torch.is_tensor(value):
                raise CheckpointError(f"optimizer state {key!r} is not a tensor; this optimizer cannot be checkpointed")
            entries.update(global_entries(f"{key}/{names[param]}", value, ids))
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return entries, groups


def load_optimizer_entries(
    optimizer: torch.optim.Optimizer, names: dict[torch.nn.Parameter, str], reader: ShardedReader,
    saved_groups: list[dict[str, Any]],
) -> None:
    """Rebuild torch's own state-dict form and load it, so torch puts each value on the device and
    dtype its optimizer implementation expects."""
    current = optimizer.state_dict()
    if len(saved_groups) != len(current["param_groups"]):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(saved_groups)} parameter groups but this run has "
            f"{len(current['param_groups'])}; load with --no-load-optim to start a fresh optimizer"
        )
    state_keys: dict[str, set[str]] = {}
    for entry in reader.file_of:
        key, name = entry.split("/", 1)
        state_keys.setdefault(name.split("[", 1)[0], set()).add(key)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {
        index: {key: reader.get_global(f"{key}/{names[p]}", expert_ids(p)) for key in state_keys[names[p]]}
        for index, p in enumerate(params) if names[p] in state_keys
    }
    groups = [{**saved, "params": group["params"]} for saved, group in zip(saved_groups, current["param_groups"])]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def save_rng_state(path: Path) -> None:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["torch_cuda"] = torch.cuda.get_rng_state()
    np_state = np.random.get_state()
    metadata = {
        "python": json.dumps(random.getstate()),
        "numpy": json.dumps([np_state[0], np_state[1].tolist(), *np_state[2:]]),
    }
    save_tensors(path, tensors, metadata)


def load_rng_state(path: Path) -> None:
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
        torch.set_rng_state(handle.get_tensor("torch_cpu"))
        if torch.cuda.is_available() and "torch_cuda" in handle.keys():
            torch.cuda.set_rng_state(handle.get_tensor("torch_cuda"))
    version, state, gauss = json.loads(metadata["python"])
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = json.loads(metadata["numpy"])
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
