"""Running the links of tensor_maps.py one way or the other: first on meta tensors, for the name,
dtype and shape of every output (a file's header is written before its data), then on real
tensors, one link at a time, when the writer asks for an output. A link's other outputs wait
until written (they follow each other in a file), so memory holds one link's tensors at a time.
"""

from collections.abc import Callable

import torch

from megatron.hf.safetensors_io import Planned, TensorIndex, TensorInfo
from megatron.hf.tensor_maps import Link, Tensors


def sides(link: Link, to_hf: bool) -> tuple[tuple[str, ...], tuple[str, ...], Callable[..., Tensors]]:
    """A link's inputs, outputs and function in one direction."""
    return (link.ours, link.theirs, link.to_hf) if to_hf else (link.theirs, link.ours, link.from_hf)


def output_dtype(dtype: torch.dtype, cast_to: torch.dtype | None) -> torch.dtype:
    return cast_to if cast_to is not None and dtype.is_floating_point else dtype


def plan(links: list[Link], to_hf: bool, inputs: dict[str, TensorInfo], cast_to: torch.dtype | None) -> list[Planned]:
    """Every output of `links` with its dtype and shape, worked out from the inputs' without data."""
    planned = []
    for link in links:
        names, outputs, function = sides(link, to_hf)
        made = function(*(inputs[name].meta() for name in names))
        planned += [
            Planned(name, TensorInfo(output_dtype(tensor.dtype, cast_to), tuple(tensor.shape)))
            for name, tensor in zip(outputs, made)
        ]
    return planned


class LinkRunner:
    """Makes outputs by name from the tensors of `index`."""

    def __init__(self, links: list[Link], to_hf: bool, index: TensorIndex, cast_to: torch.dtype | None) -> None:
        self.to_hf, self.index, self.cast_to = to_hf, index, cast_to
        self.link_of = {name: link for link in links for name in sides(link, to_hf)[1]}
        self.waiting: dict[str, torch.Tensor] = {}

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.waiting:
            names, outputs, function = sides(self.link_of[name], self.to_hf)
            self.waiting.update(zip(outputs, function(*(self.index.read(n) for n in names))))
        tensor = self.waiting.pop(name)
        return tensor.to(output_dtype(tensor.dtype, self.cast_to))
