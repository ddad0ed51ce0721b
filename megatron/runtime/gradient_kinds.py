"""What a parameter's gradient is across model-parallel ranks, for the gradient norm: a
tensor-parallel slice (the slices add up over the tensor-parallel group), whole on every
tensor-parallel rank (counted once), or a pipeline stage's copy of a parameter the first stage holds
(the tied word embedding on the last stage: its gradient is summed into the first stage's, which
alone counts it).
"""

import torch

from megatron.model.tensor_parallel import tensor_parallel_split

SLICE, WHOLE, COPY = "slice", "whole", "copy"


def pipeline_shared(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the first and last pipeline stages both hold (a tied word embedding), whose
    gradients are summed over the two before each step."""
    return [p for p in module.parameters() if getattr(p, "pipeline_shared", False)]


def gradient_kind(param: torch.Tensor) -> str:
    if getattr(param, "shared_with_first_stage", False):
        return COPY
    return SLICE if tensor_parallel_split(param) is not None else WHOLE
