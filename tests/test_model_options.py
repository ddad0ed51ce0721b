"""Megatron-LM's model options (SwiGLU, RMSNorm, no linear biases, untied output layer, GQA,
--kv-channels, qk norms, learned/rope/no positions, partial rotary): the same logits as Hugging
Face's Llama, Qwen3 and GPT-NeoX given the same weights, and composing with the KV cache,
checkpoints, model sizing and MoE layers. Defaults keep the classic GPT (tests/test_model.py)."""

import json
import math
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megatron.checkpoint.layout import MANIFEST_FILE, iteration_tag
from megatron.checkpoint.manifest import json_checksum
from megatron.config.flags import build_parser, model_config_from_args
from megatron.errors import ConfigError
from megatron.inference.checkpoint_model import load_model
from megatron.inference.generation import generate
from megatron.inference.mode import inference_config
from megatron.model import GPTConfig, GPTModel, transformer
from megatron.model_size import model_size
from megatron.parallel import single_process_grid
from megatron.training.loop import Trainer
from tests import inference_fixtures
from tests.training_fixtures import tiny_config, write_corpus

SINGLE = single_process_grid(torch.device("cpu"))
one_thread = inference_fixtures.one_thread  # autouse: this module's tiny models run on one thread
TINY = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=64,
    max_position_embeddings=32,
    ffn_hidden_size=48,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    init_method_std=0.2,
)
# Llama: RMSNorm, SwiGLU, no biases, untied, GQA (2 groups of 2 heads), rope only, a head dim of its own
LLAMA = dict(
    TINY,
    normalization="RMSNorm",
    norm_epsilon=1e-6,
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    num_query_groups=2,
    kv_channels=12,
    position_embedding_type="rope",
    rotary_base=5000.0,
)
LLAMA_HF = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    max_position_embeddings=32,
    rms_norm_eps=1e-6,
    rope_theta=5000.0,
    tie_word_embeddings=False,
    attention_bias=False,
)
NEOX = dict(TINY, hidden_size=64, position_embedding_type="rope", rotary_percent=0.25, rotary_base=5000.0)
HF_REASON = "the Hugging Face comparisons need transformers (pip install transformers)"
OLD_HF_NAMES = {"lm_head.weight": "embed_out.weight"}  # GPT-NeoX's output layer before transformers 5
NEW_FIELDS = {
    "normalization",
    "swiglu",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
    "num_query_groups",
    "kv_channels",
    "qk_layernorm",
    "rotary_percent",
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def random_model(**options) -> GPTModel:
    """A model in inference mode (eval, MoE dropless) whose every parameter, norm weights and
    biases too, is off its init."""
    torch.manual_seed(0)
    model = GPTModel(inference_config(GPTConfig(**options))).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return model


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def tokens(batch: int = 2, seq: int = 20) -> torch.Tensor:
    return torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(1))


def grouped_qkv(weight: torch.Tensor, config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our fused GQA weight, [G, N/G + 2, D, H] (Megatron-LM's layout), as separate q, k and v weights."""
    per_group = config.num_attention_heads // config.kv_heads
    w_GXDH = weight.view(config.kv_heads, per_group + 2, config.head_dim, -1)
    return (
        w_GXDH[:, :per_group].flatten(0, 2),
        w_GXDH[:, per_group].flatten(0, 1),
        w_GXDH[:, per_group + 1].flatten(0, 1),
    )


def llama_state(model: GPTModel) -> dict[str, torch.Tensor]:
    """Our Llama-style weights under transformers' Llama (and Qwen3) names."""
    c, f = model.config, model.config.ffn_hidden_size
    state = {
        "model.embed_tokens.weight": model.word_embeddings.weight,
        "model.norm.weight": model.final_layernorm.weight,
        "lm_head.weight": model.output_layer.weight,
    }
    for index, layer in enumerate(model.layers):
        prefix, attention = f"model.layers.{index}.", layer.self_attention
        q, k, v = grouped_qkv(attention.query_key_value.weight, c)
        state |= {
            prefix + "self_attn.q_proj.weight": q,
            prefix + "self_attn.k_proj.weight": k,
            prefix + "self_attn.v_proj.weight": v,
            prefix + "self_attn.o_proj.weight": attention.dense.weight,
            prefix + "input_layernorm.weight": layer.input_layernorm.weight,
            prefix + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
            prefix + "mlp.gate_proj.weight": layer.mlp.dense_h_to_4h.weight[:f],
            prefix + "mlp.up_proj.weight": layer.mlp.dense_h_to_4h.weight[f:],
            prefix + "mlp.down_proj.weight": layer.mlp.dense_4h_to_h.weight,
        }
        if c.qk_layernorm:
            state |= {
                prefix + "self_attn.q_norm.weight": attention.q_layernorm.weight,
                prefix + "self_attn.k_norm.weight": attention.k_layernorm.weight,
            }
    return state


def neox_state(model: GPTModel) -> dict[str, torch.Tensor]:
    """Our classic-layout weights under transformers' GPT-NeoX names: NeoX fuses q, k, v per head
    ([N, 3, D]) where our classic layout has all queries, then keys, then values ([3, N, D])."""
    c = model.config
    state = {
        "gpt_neox.embed_in.weight": model.word_embeddings.weight,
        "lm_head.weight": model.word_embeddings.weight,
        "gpt_neox.final_layer_norm.weight": model.final_layernorm.weight,
        "gpt_neox.final_layer_norm.bias": model.final_layernorm.bias,
    }
    for index, layer in enumerate(model.layers):
        prefix = f"gpt_neox.layers.{index}."
        for name, tensor in layer.state_dict().items():
            name = name.replace("self_attention.", "attention.")
            if "query_key_value" in name:
                tensor = tensor.view(3, c.num_attention_heads, c.head_dim, -1).transpose(0, 1).reshape(tensor.shape)
            state[prefix + name] = tensor
    return state


def assert_same_logits(model: GPTModel, hf_config: Any, state: dict[str, torch.Tensor]) -> None:
    """`model`'s logits equal, to 1e-5 relative, those of transformers' model of `hf_config` holding `state`."""
    transformers = pytest.importorskip("transformers", reason=HF_REASON)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
    names = set(hf.state_dict())
    hf.load_state_dict(
        {name if name in names else OLD_HF_NAMES.get(name, name): tensor for name, tensor in state.items()}, strict=True
    )
    with torch.no_grad():
        ours, theirs = model(tokens()).logits_BSV, hf(tokens()).logits
    assert theirs.std() > 0.5  # logits far from zero, so agreement means something
    assert relative_error(ours, theirs) < 1e-5


def test_llama_style_model_equals_transformers_llama():
    transformers = pytest.importorskip("transformers", reason=HF_REASON)
    model = random_model(**LLAMA)
    assert_same_logits(model, transformers.LlamaConfig(**LLAMA_HF, mlp_bias=False), llama_state(model))


def test_qk_rmsnorm_equals_transformers_qwen3():
    """Qwen3 is Llama with an RMSNorm over each head's queries and keys before rope: --qk-layernorm."""
    transformers = pytest.importorskip("transformers", reason=HF_REASON)
    model = random_model(**LLAMA, qk_layernorm=True)
    assert_same_logits(model, transformers.Qwen3Config(**LLAMA_HF), llama_state(model))


def test_partial_rotary_model_equals_transformers_gpt_neox():
    transformers = pytest.importorskip("transformers", reason=HF_REASON)
    model = random_model(**NEOX)
    config = transformers.GPTNeoXConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
        layer_norm_eps=1e-5,
        rotary_pct=0.25,
        rotary_emb_base=5000.0,
        use_parallel_residual=False,
        hidden_act="gelu",
        tie_word_embeddings=False,
    )
    assert_same_logits(model, config, neox_state(model))


def test_qk_layernorm_normalises_each_heads_queries_and_keys():
    """Attention written out by hand: LayerNorm over each head's D of queries and keys, then softmax."""
    model = random_model(**TINY, qk_layernorm=True, position_embedding_type="none")
    attention, (n, d) = model.layers[0].self_attention, (4, 8)
    x_BSH = torch.randn(2, 10, 32)
    q_BSND, k_BSND, v_BSND = attention.query_key_value(x_BSH).view(2, 10, 3, n, d).unbind(2)
    q_BSND = F.layer_norm(q_BSND, (d,), attention.q_layernorm.weight, attention.q_layernorm.bias, 1e-5)
    k_BSND = F.layer_norm(k_BSND, (d,), attention.k_layernorm.weight, attention.k_layernorm.bias, 1e-5)
    scores_BNSS = torch.einsum("bsnd,btnd->bnst", q_BSND, k_BSND) / math.sqrt(d)
    scores_BNSS = scores_BNSS.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    out_BSND = torch.einsum("bnst,btnd->bsnd", scores_BNSS.softmax(-1), v_BSND)
    with torch.no_grad():
        expected = attention.dense(out_BSND.reshape(2, 10, n * d))
        torch.testing.assert_close(attention(x_BSH, torch.arange(10).expand(2, 10)), expected)


@pytest.mark.parametrize("groups, experts", [(2, 1), (1, 1), (2, 4)])
def test_kv_cache_holds_the_key_value_heads_and_equals_the_full_forward(groups, experts):
    options = dict(LLAMA, num_query_groups=groups, rotary_percent=0.5, qk_layernorm=True)
    if experts > 1:  # MoE layers keep GELU experts with biases for now
        options |= dict(num_experts=(experts,), swiglu=False, add_bias_linear=True)
    model = random_model(**options)
    tokens_BS = tokens(2, 12)
    with torch.no_grad():
        full_BSV = model(tokens_BS).logits_BSV
        cache = model.new_kv_cache(2, 12)
        steps = [model(tokens_BS[:, :5], kv_cache=cache).logits_BSV] + [
            model(tokens_BS[:, t : t + 1], kv_cache=cache).logits_BSV for t in range(5, 12)
        ]
    assert cache.layers[0].keys_BGLD.shape == (2, groups, 12, 12)
    torch.testing.assert_close(torch.cat(steps, dim=1), full_BSV, rtol=1e-4, atol=1e-5)
    prompt_BS = tokens_BS[:, :4]
    assert generate(model, prompt_BS, 16, use_cache=True) == generate(model, prompt_BS, 16, use_cache=False)


def test_gqa_without_sdpa_enable_gqa_repeats_the_key_value_heads(monkeypatch):
    """torch 2.4 (which the package allows) has no enable_gqa: repeated key/value heads, same logits."""
    model = random_model(**LLAMA)
    monkeypatch.setattr(transformer, "sdpa_takes_gqa", lambda: False)
    repeating = GPTModel(model.config).eval()
    repeating.load_state_dict(model.state_dict())
    assert repeating.layers[0].self_attention.kv_repeats == 2 and not repeating.layers[0].self_attention.sdpa_gqa
    with torch.no_grad():
        torch.testing.assert_close(repeating(tokens()).logits_BSV, model(tokens()).logits_BSV, rtol=1e-5, atol=1e-6)


MODERN_FLAGS = dict(
    swiglu=True,
    normalization="RMSNorm",
    disable_bias_linear=True,
    untie_embeddings_and_output_weights=True,
    group_query_attention=True,
    num_query_groups=2,
    kv_channels=12,
    qk_layernorm=True,
    position_embedding_type="rope",
    rotary_percent=0.5,
    norm_epsilon=1e-6,
)


def test_a_checkpoint_keeps_the_options_and_the_logits(corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    trainer = Trainer(tiny_config(corpus, train_iters=2, lr_warmup_iters=1, save=save, **MODERN_FLAGS), SINGLE)
    trainer.train()
    loaded = load_model(save)
    assert loaded.config == inference_config(trainer.model_config)
    assert loaded.config.num_query_groups == 2 and loaded.config.norm_epsilon == 1e-6
    model = trainer.engine.module.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.model(tokens(2, 16)).logits_BSV, model(tokens(2, 16)).logits_BSV, rtol=0, atol=0
        )
    resumed = Trainer(tiny_config(corpus, train_iters=3, lr_warmup_iters=1, load=save, **MODERN_FLAGS), SINGLE)
    assert resumed.iteration == 2


def as_saved_before_the_options(folder: Path) -> None:
    """Rewrite the checkpoint in `folder` to record its model as the toolkit did before these options:
    no new fields, `layernorm_epsilon` (the manifest's checksum recomputed, so it still verifies)."""
    path = folder / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    model = {name: value for name, value in manifest["run"]["model"].items() if name not in NEW_FIELDS}
    model["layernorm_epsilon"] = model.pop("norm_epsilon")
    manifest["run"]["model"] = model
    manifest["checksum"] = json_checksum(manifest)
    path.write_text(json.dumps(manifest))


def test_a_classic_checkpoint_saved_before_the_options_loads_with_the_defaults(corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    trainer = Trainer(tiny_config(corpus, train_iters=2, lr_warmup_iters=1, save=save, layernorm_epsilon=1e-4), SINGLE)
    trainer.train()
    as_saved_before_the_options(tmp_path / "ckpt" / iteration_tag(2))
    assert (
        "norm_epsilon"
        not in json.loads((tmp_path / "ckpt" / iteration_tag(2) / MANIFEST_FILE).read_text())["run"]["model"]
    )
    loaded = load_model(save)
    assert loaded.config == inference_config(trainer.model_config) and loaded.config.norm_epsilon == 1e-4
    assert {f.name for f in fields(GPTConfig)} >= NEW_FIELDS
    model = trainer.engine.module.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.model(tokens(2, 16)).logits_BSV, model(tokens(2, 16)).logits_BSV, rtol=0, atol=0
        )


def sized(flags: str) -> GPTConfig:
    args = build_parser(sizing=True).parse_args(
        f"--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 {flags}".split()
    )
    return model_config_from_args(args)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            "--group-query-attention --num-query-groups 3",
            "--num-query-groups 3 does not divide --num-attention-heads 4",
        ),
        ("--num-query-groups 2", "--num-query-groups needs --group-query-attention"),
        ("--position-embedding-type rope --rotary-percent 1.5", r"--rotary-percent 1.5 is outside \(0, 1\]"),
        ("--rotary-percent 0", "--rotary-percent: '0' is not a positive number"),
        ("--rotary-percent 0.5", "--rotary-percent applies to rotary embeddings only"),
        (
            "--position-embedding-type rope --rotary-percent 0.375",
            "--rotary-percent 0.375 of head dim 8 rotates 3 dims",
        ),
        ("--position-embedding-type rope --kv-channels 7", "--rotary-percent 1.0 of head dim 7 rotates 7 dims"),
        ("--hidden-size 30", "give --kv-channels"),
        ("--normalization BatchNorm", "--normalization: invalid choice: 'BatchNorm'"),
        ("--num-experts 4 --moe-shared-expert-gate", "--moe-shared-expert-gate gates the shared experts"),
        ("--moe-shared-expert-intermediate-size 16", "adds shared experts to MoE layers, but this model has none"),
        ("--num-experts 4 --mlp-type residual --moe-shared-expert-intermediate-size 16", "choose one"),
    ],
)
def test_a_bad_combination_names_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message):
        sized(flags)


def test_layernorm_epsilon_is_an_alias_of_norm_epsilon():
    assert sized("--layernorm-epsilon 1e-3").norm_epsilon == sized("--norm-epsilon 1e-3").norm_epsilon == 1e-3


def expected_parameters(c: GPTConfig) -> int:
    """Every weight and bias the options call for, counted by hand."""
    h, f, v, n, g, d = c.hidden_size, c.ffn_hidden_size, c.vocab_size, c.num_attention_heads, c.kv_heads, c.head_dim
    bias, norm = int(c.add_bias_linear), (1 if c.normalization == "RMSNorm" else 2)
    gated_f = 2 * f if c.swiglu else f
    attention = (h + bias) * (n + 2 * g) * d + (n * d + bias) * h + c.qk_layernorm * 2 * norm * d
    layer = attention + (h + bias) * gated_f + (f + bias) * h + 2 * norm * h
    embeddings = v * h * (2 if c.untie_embeddings_and_output_weights else 1)
    positions = c.max_position_embeddings * h if c.position_embedding_type == "learned_absolute" else 0
    return embeddings + positions + c.num_layers * layer + norm * h


OPTION_SETS = [
    "",
    "--swiglu --normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights "
    "--group-query-attention --num-query-groups 2 --position-embedding-type rope",
    "--group-query-attention --kv-channels 12 --qk-layernorm --position-embedding-type none --ffn-hidden-size 40",
    "--swiglu --qk-layernorm --normalization RMSNorm --position-embedding-type rope --rotary-percent 0.5",
]


@pytest.mark.parametrize("flags", OPTION_SETS)
def test_model_size_counts_the_parameters_and_flops_of_the_options(flags):
    config = GPTConfig(**{**asdict(sized(flags)), "vocab_size": 64})
    model = GPTModel(config).eval()
    assert model_size(config, 16).total == sum(p.numel() for p in model.parameters()) == expected_parameters(config)
    # the math kernel runs attention as matmuls, so the counter sees the full S x S of Megatron's formula
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(tokens(2, 16))
    assert counter.get_total_flops() == config.flops_per_token(16) / 3 * 2 * 16


def test_fine_grained_experts_take_their_own_width():
    """--moe-ffn-hidden-size sizes the experts only; PR-MoE's residual MLP keeps --ffn-hidden-size."""
    flags = "--num-experts 4 --ffn-hidden-size 48 --moe-ffn-hidden-size 16 --mlp-type residual --moe-router-topk 2"
    config = replace(sized(flags), vocab_size=64)
    moe = GPTModel(config).layers[1].mlp
    assert moe.experts.w1.shape == (4, 32, 16) and moe.experts.w2.shape == (4, 16, 32)
    assert moe.residual_mlp.dense_h_to_4h.out_features == 48 and config.moe.topk == 2
    wide = replace(config, moe_ffn_hidden_size=48)
    # one MoE layer, 2 experts per token, fwd+bwd = 3 x forward's 2 GEMMs of 2 h f FLOPs each
    assert config.flops_per_token(16) - wide.flops_per_token(16) == 3 * 2 * 2 * 2 * 32 * (16 - 48)
    assert model_size(config, 16).total == sum(p.numel() for p in GPTModel(config).parameters())


def test_swiglu_experts_without_biases_follow_the_dense_options():
    """--swiglu and --disable-bias-linear shape the routed experts as they shape the dense MLP."""
    flags = "--num-experts 4 --moe-ffn-hidden-size 16 --moe-router-topk 2"
    config = replace(sized(flags + " --swiglu --disable-bias-linear"), vocab_size=64)
    experts = GPTModel(config).layers[1].mlp.experts
    assert experts.swiglu and experts.w1.shape == (4, 32, 32) and experts.w2.shape == (4, 16, 32)
    assert experts.b1 is None and experts.b2 is None
    gelu = replace(config, swiglu=False)
    # dense layer: one more GEMM of 2 h f; MoE layer: k experts, one more GEMM of 2 h f' each; fwd+bwd = 3x
    assert config.flops_per_token(16) - gelu.flops_per_token(16) == 3 * (2 * 32 * 128 + 2 * 2 * 32 * 16)
    assert model_size(config, 16).total == sum(p.numel() for p in GPTModel(config).parameters())
    assert model_size(config, 16).total - model_size(replace(config, add_bias_linear=True), 16).total == -(
        2 * (3 * 32 + 32) + (2 * 128 + 32) + 4 * (2 * 16 + 32)
    )  # both attentions', the dense MLP's, 4 experts'


@pytest.mark.parametrize("gated", [False, True])
def test_shared_experts_add_a_dense_mlp_to_the_routed_output(gated):
    flags = f"--num-experts 4 --moe-shared-expert-intermediate-size 24{' --moe-shared-expert-gate' if gated else ''}"
    config = replace(sized(flags), vocab_size=64, init_method_std=0.2)
    layer = GPTModel(config).layers[1].mlp.eval()
    x_BSH = torch.randn(2, 5, 32)
    with torch.no_grad():
        with_shared = layer(x_BSH).hidden_BSH
        shared = layer.shared_expert
        x_TH = x_BSH.reshape(-1, 32)
        mlp = shared.mlp
        expected_TH = mlp.dense_4h_to_h(F.gelu(mlp.dense_h_to_4h(x_TH)))
        assert mlp.dense_h_to_4h.out_features == 24 and (shared.gate is not None) == gated
        if gated:
            expected_TH = expected_TH * torch.sigmoid(x_TH @ shared.gate.weight.t())
        layer.shared_expert = None
        routed_only = layer(x_BSH).hidden_BSH
    torch.testing.assert_close(with_shared - routed_only, expected_TH.view(2, 5, 32), rtol=1e-5, atol=1e-6)
    plain = replace(config, moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False)
    # one MoE layer: fwd+bwd = 3 x (the shared MLP's 2 GEMMs of 2 h f FLOPs, and the gate's 2 h)
    assert config.flops_per_token(16) - plain.flops_per_token(16) == 3 * (2 * 2 * 32 * 24 + 2 * 32 * gated)
    assert model_size(config, 16).total == sum(p.numel() for p in GPTModel(config).parameters())


def test_defaults_build_the_classic_model():
    classic = GPTModel(GPTConfig(**TINY))
    names = set(classic.state_dict())
    assert "layers.0.self_attention.query_key_value.bias" in names and "output_layer.weight" not in names
    assert not any("q_layernorm" in name for name in names) and "position_embeddings.weight" in names
    assert classic.layers[0].mlp.dense_h_to_4h.weight.shape == (48, 32)
    assert isinstance(classic.final_layernorm, torch.nn.LayerNorm)


def test_untied_output_layer_is_initialised_with_init_method_std():
    torch.manual_seed(0)
    model = GPTModel(
        GPTConfig(
            **dict(TINY, hidden_size=256, vocab_size=512, init_method_std=0.05),
            untie_embeddings_and_output_weights=True,
            swiglu=True,
        )
    )
    assert model.output_layer.weight.std().item() == pytest.approx(0.05, rel=0.05)
    assert model.output_layer.weight.data_ptr() != model.word_embeddings.weight.data_ptr()
    assert model.layers[0].mlp.dense_h_to_4h.weight.std().item() == pytest.approx(0.05, rel=0.05)
