import math

import pytest
import torch

from megatron.errors import ConfigError
from megatron.model import GPTConfig, GPTModel


def tiny_config(**overrides) -> GPTConfig:
    values = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=128,
        max_position_embeddings=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    values.update(overrides)
    return GPTConfig(**values)


@pytest.mark.parametrize("position", ["learned_absolute", "rope"])
def test_forward_shapes(position):
    torch.manual_seed(0)
    model = GPTModel(tiny_config(position_embedding_type=position))
    tokens = torch.randint(0, 128, (3, 16))
    without_labels = model(tokens)
    assert without_labels.logits_BSV.shape == (3, 16, 128) and without_labels.losses_BS is None
    output = model(tokens, labels_BS=tokens)
    assert output.router_loss.item() == 0.0 and output.routing == {} and output.logits_BSV is None
    assert output.losses_BS.shape == (3, 16) and output.losses_BS.dtype == torch.float32
    both = model(tokens, labels_BS=tokens, return_logits=True)
    torch.testing.assert_close(both.logits_BSV, without_labels.logits_BSV, rtol=0, atol=0)
    torch.testing.assert_close(both.losses_BS, output.losses_BS, rtol=0, atol=0)


@pytest.mark.parametrize("position", ["learned_absolute", "rope"])
def test_future_tokens_never_change_earlier_outputs(position):
    torch.manual_seed(0)
    model = GPTModel(tiny_config(position_embedding_type=position)).eval()
    tokens = torch.randint(0, 128, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = torch.randint(0, 128, (2, 6))
    with torch.no_grad():
        before, after = model(tokens).logits_BSV, model(changed).logits_BSV
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_input_and_output_embeddings_are_tied():
    model = GPTModel(tiny_config())
    names = [name for name, _ in model.named_parameters()]
    assert "word_embeddings.weight" in names
    assert not any("lm_head" in name or "output_layer" in name for name in names)


def test_megatron_init_scales_output_projections():
    torch.manual_seed(0)
    config = tiny_config(num_layers=8, hidden_size=256, num_attention_heads=4, init_method_std=0.02)
    model = GPTModel(config)
    block = model.layers[0]
    assert block.self_attention.query_key_value.weight.std().item() == pytest.approx(0.02, rel=0.05)
    scaled = 0.02 / math.sqrt(2 * 8)
    assert block.self_attention.dense.weight.std().item() == pytest.approx(scaled, rel=0.05)
    assert block.mlp.dense_4h_to_h.weight.std().item() == pytest.approx(scaled, rel=0.05)
    assert torch.count_nonzero(block.mlp.dense_h_to_4h.bias) == 0


def test_activation_checkpointing_gives_the_same_gradients():
    tokens = torch.randint(0, 128, (2, 16))
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = GPTModel(tiny_config(checkpoint_activations=checkpointed, hidden_dropout=0.1))
        torch.manual_seed(1)
        model(tokens, labels_BS=tokens).losses_BS.mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(plain, recomputed)


def test_ffn_hidden_size_defaults_to_four_times_hidden():
    assert tiny_config().ffn_hidden_size == 128
    assert tiny_config(ffn_hidden_size=48).ffn_hidden_size == 48


def test_heads_must_divide_hidden_size():
    with pytest.raises(ConfigError, match="not divisible"):
        tiny_config(num_attention_heads=5)
