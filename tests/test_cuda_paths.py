"""The CUDA paths: the same model, engine and trainer on a GPU, in fp32, bf16 and fp16."""

import pytest
import torch

from megatron.model import GPTConfig, GPTModel
from megatron.parallel import ParallelGrid, single_process_grid
from megatron.runtime import initialize
from megatron.training.loop import Trainer
from tests.training_fixtures import tiny_config, write_corpus

pytestmark = pytest.mark.cuda


def cuda_grid() -> ParallelGrid:
    return single_process_grid(torch.device("cuda", 0))


def test_model_on_cuda_matches_cpu():
    config = GPTConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=128,
        max_position_embeddings=32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    model = GPTModel(config).eval()
    tokens = torch.randint(0, 128, (2, 32))
    with torch.no_grad():
        cpu = model(tokens).logits_BSV
        gpu = model.cuda()(tokens.cuda()).logits_BSV.cpu()
    torch.testing.assert_close(gpu, cpu, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_engine_mixed_precision_step_on_cuda(precision):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)).cuda()
    engine = initialize(
        model,
        {
            "train_batch_size": 8,
            precision: {"enabled": True},
            "optimizer": {"params": {"lr": 1e-2}},
            "gradient_clipping": 1.0,
        },
        cuda_grid(),
    )
    x, y = torch.randn(8, 64, device="cuda"), torch.randn(8, 1, device="cuda")
    losses = []
    for _ in range(20):
        loss = ((engine(x).float() - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    assert losses[-1] < losses[0] * 0.5


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_tiny_training_run_on_cuda(tmp_path, precision):
    corpus = write_corpus(tmp_path)
    config = tiny_config(
        corpus,
        train_iters=30,
        eval_interval=30,
        eval_at_start=True,
        lr=1e-2,
        min_lr=1e-3,
        **{precision: True},
        initial_loss_scale=2.0**16,
        save=str(tmp_path / "ckpt"),
    )
    result = Trainer(config, cuda_grid()).train()
    (_, first), (_, last) = result.validation
    assert last < first - 0.5


def test_moe_layer_on_cuda_matches_cpu():
    from megatron.model.moe import MoEConfig, MoELayer

    torch.manual_seed(0)
    layer = MoELayer(64, 256, 8, MoEConfig(topk=2, use_rts=False, sample_second_expert=False), 0.02, 0.01).eval()
    x = torch.randn(4, 32, 64)
    with torch.no_grad():
        cpu = layer(x)
        layer.cuda()
        gpu = layer(x.cuda())
        with torch.autocast("cuda", dtype=torch.bfloat16):
            bf16_out = layer(x.cuda()).hidden_BSH
    cpu_out, cpu_loss, gpu_out, gpu_loss = cpu.hidden_BSH, cpu.router_loss, gpu.hidden_BSH, gpu.router_loss
    torch.testing.assert_close(gpu_out.cpu(), cpu_out, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(gpu_loss.cpu(), cpu_loss, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(bf16_out.float().cpu(), cpu_out, rtol=5e-2, atol=5e-2)


def test_moe_training_run_on_cuda(tmp_path):
    corpus = write_corpus(tmp_path)
    config = tiny_config(
        corpus,
        train_iters=30,
        eval_interval=30,
        eval_at_start=True,
        lr=1e-2,
        min_lr=1e-3,
        bf16=True,
        num_experts=4,
        topk=2,
    )
    result = Trainer(config, cuda_grid()).train()
    (_, first), (_, last) = result.validation
    assert last < first - 0.5
