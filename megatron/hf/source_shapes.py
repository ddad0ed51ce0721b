"""Import's check that a Hugging Face folder's tensors have the shapes its config.json calls for,
before any of them is split or fused (a wrong hidden size would otherwise end in a torch error
inside the QKV split). The shapes called for are our model's, built from the config, run through
the export links on meta tensors; a refusal names the tensor, both shapes and the config.json key
the differing size comes from, where one does.
"""

import json
from pathlib import Path
from typing import Any

import torch

from megatron.checkpoint.tensor_file import TensorInfo
from megatron.errors import CheckpointError
from megatron.hf.link_runner import plan
from megatron.hf.safetensors_io import TensorIndex
from megatron.hf.tensor_maps import Link

# config.json keys (as the classes spell them) that give one size of some tensor
SIZE_KEYS = (
    "vocab_size",
    "n_embd",
    "hidden_size",
    "n_inner",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "n_positions",
    "max_position_embeddings",
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "head_dim",
)
HEAD_KEYS = ("n_head", "num_attention_heads", "num_key_value_heads")  # rows of heads x head_dim


def hf_shapes(links: list[Link], ours: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The shape of every Hugging Face tensor of `links`, from our entries' shapes `ours`."""
    inputs = {name: TensorInfo(torch.float32, shape) for name, shape in ours.items()}
    return {entry.name: entry.info.shape for entry in plan(links, True, inputs, None)}


def config_keys_of(size: int, config_file: Path, hf: Any) -> str | None:
    """The key (or product of keys) of `config_file` that gives `size`, as "n_embd of 36"."""
    raw = json.loads(config_file.read_text())
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    found = [key for key in SIZE_KEYS if raw.get(key) == size] or [
        f"{key} x head_dim" for key in HEAD_KEYS if isinstance(raw.get(key), int) and raw[key] * head_dim == size
    ]
    return f"{' or '.join(found)} of {size}" if found else None


def refuse_wrong_shapes(
    links: list[Link], ours: dict[str, tuple[int, ...]], index: TensorIndex, hf_dir: Path, hf: Any
) -> None:
    """Refuse the first tensor of `index` whose shape is not the one the config (`hf`, read from
    `hf_dir`/config.json) calls for; every tensor `links` reads must be in `index`."""
    for name, expected in hf_shapes(links, ours).items():
        found = index.info[name].shape
        if found == expected:
            continue
        called_for = next((b for a, b in zip(found, expected) if a != b), None) if len(found) == len(expected) else None
        keys = config_keys_of(called_for, hf_dir / "config.json", hf) if called_for is not None else None
        source = f"{hf_dir / 'config.json'}" + (f"'s {keys}" if keys else "")
        raise CheckpointError(
            f"{name} in {index.file_of[name]} has shape {found} but {source} calls for {expected}; "
            "give the config.json that was saved with these weights"
        )
