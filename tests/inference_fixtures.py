"""Tiny models, a byte tokenizer and tiny checkpoints for the generation and evaluation tests."""

from collections.abc import Iterator, Sequence

import pytest
import torch

from megatron.data.tokenizer import Tokenizer
from megatron.inference.mode import inference_config
from megatron.model import GPTConfig, GPTModel
from megatron.model.moe import MoEConfig
from megatron.parallel import build_parallel_grid
from megatron.training.loop import Trainer
from tests.training_fixtures import tiny_config


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models run about twice as fast on one thread here: a second thread mostly waits for
    the other core. Imported by a test module, it applies to that module's tests only."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids, 256 as end of document: real text without tokenizer files."""

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def eod(self) -> int:
        return 256

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def tiny_model(
    experts: int = 1,
    position: str = "learned_absolute",
    vocab: int = 64,
    max_positions: int = 32,
    seed: int = 0,
    topk: int = 2,
) -> GPTModel:
    """A random 2-layer GPT in inference mode (eval, MoE dropless); with experts > 1 layer 2 is MoE."""
    torch.manual_seed(seed)
    config = GPTConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        position_embedding_type=position,
        num_experts=(experts,),
        moe=MoEConfig(topk=topk),
    )
    return GPTModel(inference_config(config)).eval()


MOE = {"num_experts": 4, "topk": 2, "hidden_dropout": 0.0, "attention_dropout": 0.0}


def train_checkpoint(corpus: str, save: str, ep_size: int = 1, train_iters: int = 3) -> dict[str, torch.Tensor]:
    """Train a tiny MoE model (NullTokenizer) for a few iterations and save it; run under torchrun
    or `run_distributed` for ep_size > 1."""
    grid = build_parallel_grid(torch.device("cpu"), ep_size=ep_size)
    config = tiny_config(
        corpus,
        dp_size=grid.dp_size,
        train_iters=train_iters,
        micro_batch_size=1,
        global_batch_size=2 * grid.dp_size,
        moe_expert_parallel_size=ep_size,
        save=save,
        **MOE,
    )
    Trainer(config, grid).train()
    return {}
