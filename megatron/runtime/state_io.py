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
    """Rebuild torch's own state-dict form from the name-keyed state and load it, so torch puts
    each value on the device and dtype its optimizer implementation expects."""
    current = optimizer.state_dict()
    if len(meta["param_groups"]) != len(current["param_groups"]):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(meta['param_groups'])} parameter groups but this "
            f"run has {len(current['param_groups'])}; load with --no-load-optim to start a fresh optimizer"
        )
    by_name: dict[str, dict[str, Any]] = {}
    for flat_key, value in [*tensors.items(), *meta["scalars"].items()]:
        key, name = flat_key.split("/", 1)
        by_name.setdefault(name, {})[key] = value
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {index: by_name[names[p]] for index, p in enumerate(params) if names[p] in by_name}
    groups = [{**saved, "params": group["params"]} for saved, group in zip(meta["param_groups"], current["param_groups"])]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


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
