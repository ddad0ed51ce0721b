"""The GPT model under tensor parallelism (and sequence parallelism) equals the single-process model:
same initial weights (each rank holds its slice of TP=1's), same per-token losses and logits, and
each rank's gradients are its slices of TP=1's, on 2 gloo ranks."""

import pytest
import torch
import torch.distributed as dist

from megatron.errors import ConfigError
from megatron.model import GPTConfig, GPTModel
from megatron.model.tensor_parallel import TensorParallel
from megatron.placement import tensor_parallel_split
from megatron.tensor_split import shard
from tests.dist_utils import run_distributed

BASE = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=64,
    max_position_embeddings=16,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
CASES = {
    "classic": {},  # LayerNorm, GELU, biases, learned positions, tied head
    "modern": dict(
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        num_query_groups=2,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
        qk_layernorm=True,
    ),
    "plain_qkv_swiglu": dict(swiglu=True, qk_layernorm=True),
}


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (2, 16), generator=generator)
    return tokens, torch.randint(0, 64, (2, 16), generator=generator)


def _run(model: GPTModel) -> dict[str, torch.Tensor]:
    tokens, labels = _tokens()
    losses = model(tokens, labels_BS=labels).losses_BS
    (losses * torch.linspace(0.5, 1.5, losses.numel()).view_as(losses)).mean().backward()  # not a plain mean
    with torch.no_grad():
        logits = model(tokens).logits_BSV
    return {"losses": losses.detach(), "logits": logits}


def _compare_on_rank() -> dict[str, torch.Tensor]:
    group = dist.new_group([0, 1])
    rank = dist.get_rank()
    out: dict[str, torch.Tensor] = {}
    for case, overrides in CASES.items():
        config = GPTConfig(**{**BASE, **overrides})
        for sequence_parallel in (False, True):
            torch.manual_seed(0)
            parallel = GPTModel(config, tp=TensorParallel(group, sequence_parallel))
            torch.manual_seed(0)
            serial = GPTModel(config)
            key = f"{case}/sp{int(sequence_parallel)}"
            got, want = _run(parallel), _run(serial)
            for name in got:
                out[f"{key}/{name}"] = got[name]
                out[f"{key}/{name}.want"] = want[name]
            whole = dict(serial.named_parameters())
            for name, param in parallel.named_parameters():
                split = tensor_parallel_split(param)
                expected_value, expected_grad = whole[name].detach(), whole[name].grad
                if split is not None:
                    expected_value = shard(expected_value, split.dim, rank, 2, split.partition_sizes)
                    expected_grad = shard(expected_grad, split.dim, rank, 2, split.partition_sizes)
                out[f"{key}/{name}.value"], out[f"{key}/{name}.value.want"] = param.detach(), expected_value
                out[f"{key}/{name}.grad"], out[f"{key}/{name}.grad.want"] = param.grad, expected_grad
            out[f"{key}/split_count"] = torch.tensor(
                sum(tensor_parallel_split(p) is not None for p in parallel.parameters())
            )
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, torch.Tensor]]:
    return run_distributed(_compare_on_rank, 2)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("sequence_parallel", [0, 1])
def test_tensor_parallel_gpt_equals_the_serial_model(ranks, case: str, sequence_parallel: int) -> None:
    key = f"{case}/sp{sequence_parallel}/"
    for result in ranks:
        assert result[key + "split_count"] > 0  # the model really is split
        for name, value in result.items():
            if name.startswith(key) and not name.endswith((".want", "split_count")):
                torch.testing.assert_close(value, result[name + ".want"], rtol=1e-5, atol=1e-6, msg=name)


def test_heads_that_do_not_split_over_the_ranks_are_refused() -> None:
    config = GPTConfig(**{**BASE, "num_attention_heads": 4, "num_query_groups": 1})
    with pytest.raises(ConfigError, match="--num-query-groups 1 cannot be split over --tensor-model-parallel-size 2"):
        GPTModel(config, tp=_FakeTwoRanks())


class _FakeTwoRanks(TensorParallel):
    """A two-rank TensorParallel without processes: the size checks come before any collective."""

    @property
    def size(self) -> int:
        return 2
