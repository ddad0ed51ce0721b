"""One placement record per parameter (megatron/placement.py): what the model records on its
parameters as it builds them, and how a record changes."""

import torch
from torch import nn

from megatron.model import GPTModel
from megatron.placement import COPY, SLICE, WHOLE, Placement, place, placement_of
from megatron.tensor_split import TensorParallelSplit
from tests.test_model import tiny_config

OLD_ATTRIBUTES = ("expert_global_ids", "tensor_parallel_split", "pipeline_shared", "shared_with_first_stage")


def test_an_moe_model_places_its_experts_and_nothing_else():
    model = GPTModel(tiny_config(num_experts=(4,)))
    assert sum(".experts." in name for name, _ in model.named_parameters()) == 4  # w1, b1, w2, b2
    for name, param in model.named_parameters():
        placement = placement_of(param)
        if ".experts." in name:
            assert placement == Placement(expert_ids=(0, 1, 2, 3)), name
        else:
            assert placement is placement_of(nn.Parameter(torch.zeros(1))), name  # the plain record
        assert not any(hasattr(param, old) for old in OLD_ATTRIBUTES), name


def test_place_changes_only_the_fields_it_is_given():
    param = nn.Parameter(torch.zeros(4, 2))
    split = TensorParallelSplit(0, None, 1, 2, None)
    place(param, tp_split=split)
    place(param, pipeline_shared=True)
    assert placement_of(param) == Placement(tp_split=split, pipeline_shared=True)
    assert placement_of(param).gradient_kind == SLICE
    place(param, copy_of_first_stage=True)
    assert placement_of(param).gradient_kind == COPY
    assert placement_of(nn.Parameter(torch.zeros(1))).gradient_kind == WHOLE
