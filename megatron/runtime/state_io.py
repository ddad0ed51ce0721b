"""Engine state <-> safetensors files and JSON: model tensors, optimizer state keyed by parameter
name (so it survives a change of layout), and per-rank RNG states. Nothing is pickled."""

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megatron.errors import CheckpointError


def optimizer_state(
    optimizer: torch.optim.Optimizer, names: dict[torch.nn.Parameter, str]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split optimizer state into tensors keyed `state_key/param_name` and JSON-able rest."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            target = tensors if torch.is_tensor(value) else scalars
            target[f"{key}/{names[param]}"] = value
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return tensors, {"param_groups": groups, "scalars": scalars}


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    names: dict[torch.nn.Parameter, str],
    tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
) -> None:
    if len(meta["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(meta['param_groups'])} parameter groups but this "
            f"run has {len(optimizer.param_groups)}; load with --no-load-optim to start a fresh optimizer"
        )
    for group, saved in zip(optimizer.param_groups, meta["param_groups"]):
        group.update(saved)
    by_name: dict[str, dict[str, Any]] = {}
    for flat_key, value in [*tensors.items(), *meta["scalars"].items()]:
        key, name = flat_key.split("/", 1)
        by_name.setdefault(name, {})[key] = value
    for param, name in names.items():
        if name in by_name:
            optimizer.state[param] = {
                k: v.to(param.device) if torch.is_tensor(v) and v.dim() else v for k, v in by_name[name].items()
            }


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path), metadata=metadata)


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete, load an earlier one")
    return load_file(str(path))


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
