"""Running the links of tensor_maps.py one way or the other: first on meta tensors, for the name,
dtype and shape of every output (a file's header is written before its data), then on real
tensors, one link at a time, when the writer asks for an output. A link's other outputs wait
until written (they follow each other in a file), so memory holds one link's tensors at a time.
Every input is checked finite as it is read, and every output after a --dtype cast (which may
overflow), so that no NaN or infinity is ever converted.
"""

from collections.abc import Callable

import torch

from megatron.checkpoint.save import first_nonfinite
from megatron.checkpoint.tensor_file import Planned, TensorInfo
from megatron.errors import CheckpointError
from megatron.hf.safetensors_io import TensorIndex
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


def finite(name: str, tensor: torch.Tensor) -> bool:
    """Whether `tensor` holds no NaN and no infinity."""
    if tensor.is_floating_point() and tensor.dtype.itemsize == 1:
        tensor = tensor.to(torch.float16)  # float8 has no min/max kernels; float16 holds its range
    return first_nonfinite({name: tensor}) is None


class LinkRunner:
    """Makes outputs by name from the tensors of `index`; a NaN or infinity among them is refused
    with `refusal`, what the sentence says after naming the tensor ("so ... was not imported; ...")."""

    def __init__(
        self, links: list[Link], to_hf: bool, index: TensorIndex, cast_to: torch.dtype | None, refusal: str
    ) -> None:
        self.to_hf, self.index, self.cast_to, self.refusal = to_hf, index, cast_to, refusal
        self.link_of = {name: link for link in links for name in sides(link, to_hf)[1]}
        self.waiting: dict[str, torch.Tensor] = {}

    def read(self, name: str) -> torch.Tensor:
        tensor = self.index.read(name)
        if not finite(name, tensor):
            raise CheckpointError(f"{name} in {self.index.file_of[name]} holds a NaN or an infinity, {self.refusal}")
        return tensor

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.waiting:
            names, outputs, function = sides(self.link_of[name], self.to_hf)
            self.waiting.update(zip(outputs, function(*(self.read(n) for n in names))))
        tensor = self.waiting.pop(name)
        cast = tensor.to(output_dtype(tensor.dtype, self.cast_to))
        if cast.dtype != tensor.dtype and not finite(name, cast):
            dtype = str(cast.dtype).removeprefix("torch.")
            raise CheckpointError(
                f"{name} has values beyond the range of {dtype}, which --dtype {dtype} would make infinities; "
                "convert with a wider --dtype, or without one to keep the stored dtype"
            )
        return cast
