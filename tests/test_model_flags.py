"""The flags printed from a typed model config (config/model_flags.py) build that config again when
pretrain_gpt.py's parser reads them, field by field; a field added to GPTConfig or MoEConfig
without a flag printed for it fails here."""

from dataclasses import fields, replace

import pytest

from megatron.config.flags import build_parser, model_config_from_args
from megatron.config.model_flags import model_flags, tokenizer_flags
from megatron.model import GPTConfig
from megatron.model.moe import MoEConfig
from megatron.tokenizer_spec import NULL_EOD_EXTRA, TokenizerSpec, tokenizer_spec_of

# what the flags do not carry: the vocabulary comes from the tokenizer, PR-MoE's residual from mlp_type
DERIVED = {"vocab_size", "use_residual"}

DENSE = GPTConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=None, max_position_embeddings=16)
MOE = replace(DENSE, num_experts=(4,))

# one changed value per field (with what it needs beside it), each away from its default
MODEL_CHANGES = {
    "num_layers": dict(num_layers=6),
    "hidden_size": dict(hidden_size=48),
    "num_attention_heads": dict(num_attention_heads=8),
    "max_position_embeddings": dict(max_position_embeddings=64),
    "ffn_hidden_size": dict(ffn_hidden_size=40),
    "moe_ffn_hidden_size": dict(moe_ffn_hidden_size=24),
    "moe_shared_expert_intermediate_size": dict(moe_shared_expert_intermediate_size=20),
    "moe_shared_expert_gate": dict(moe_shared_expert_intermediate_size=20, moe_shared_expert_gate=True),
    "hidden_dropout": dict(hidden_dropout=0.0),
    "attention_dropout": dict(attention_dropout=0.25),
    "init_method_std": dict(init_method_std=0.006),
    "normalization": dict(normalization="RMSNorm"),
    "norm_epsilon": dict(norm_epsilon=1e-6),
    "swiglu": dict(swiglu=True),
    "add_bias_linear": dict(add_bias_linear=False),
    "untie_embeddings_and_output_weights": dict(untie_embeddings_and_output_weights=True),
    "num_query_groups": dict(num_query_groups=2),
    "kv_channels": dict(kv_channels=12),
    "qk_layernorm": dict(qk_layernorm=True),
    "position_embedding_type": dict(position_embedding_type="none"),
    "rotary_percent": dict(position_embedding_type="rope", rotary_percent=0.5),
    "rotary_base": dict(position_embedding_type="rope", rotary_base=500000.0),
    "checkpoint_activations": dict(checkpoint_activations=True),
    "num_experts": dict(num_experts=(2, 8)),
    "expert_interval": dict(expert_interval=1, num_experts=(8,)),
    "mlp_type": dict(mlp_type="residual", moe=MoEConfig(use_residual=True)),
    "moe": None,  # MOE_CHANGES, field by field
}
MOE_CHANGES = {
    "topk": dict(topk=2),
    "train_capacity_factor": dict(train_capacity_factor=1.25),
    "eval_capacity_factor": dict(eval_capacity_factor=2.0),
    "min_capacity": dict(min_capacity=0),
    "drop_tokens": dict(drop_tokens=False),
    "use_rts": dict(use_rts=False),
    "noisy_gate_policy": dict(noisy_gate_policy="Jitter"),
    "sample_second_expert": dict(topk=2, sample_second_expert=False),
    "aux_loss_coeff": dict(aux_loss_coeff=0.001),
    "z_loss_coeff": dict(z_loss_coeff=0.002),
    "drop_policy": dict(topk=3, drop_policy="position"),
    "router_score_function": dict(router_score_function="sigmoid"),
    "router_pre_softmax": dict(router_pre_softmax=True),
    "router_topk_scaling_factor": dict(topk=2, router_topk_scaling_factor=2.5),
    "router_enable_expert_bias": dict(router_score_function="sigmoid", router_enable_expert_bias=True),
    "router_num_groups": dict(topk=2, router_num_groups=2, router_group_topk=1),
    "router_group_topk": dict(topk=4, router_num_groups=2, router_group_topk=2),
    "router_norm_topk_prob": dict(topk=2, router_score_function="sigmoid", router_norm_topk_prob=False),
    "router_bias_update_rate": dict(router_bias_update_rate=0.01),
    "router_load_balancing_type": dict(router_load_balancing_type="seq_aux_loss"),
}


def parsed(flags: list[str], positions: int) -> GPTConfig:
    """The model pretrain_gpt.py builds from `flags`."""
    return model_config_from_args(build_parser(sizing=True).parse_args(flags + ["--seq-length", str(positions)]))


def assert_round_trip(config: GPTConfig) -> list[str]:
    flags = model_flags(config)
    assert parsed(flags, config.max_position_embeddings) == config, flags
    return flags


def test_every_field_is_printed_or_named_as_derived():
    assert {f.name for f in fields(GPTConfig)} - DERIVED == MODEL_CHANGES.keys()
    assert {f.name for f in fields(MoEConfig)} - DERIVED == MOE_CHANGES.keys()


@pytest.mark.parametrize("name", [name for name in MODEL_CHANGES if name != "moe"])
def test_a_changed_model_field_comes_back_from_its_flags(name):
    base = MOE if name.startswith("moe_") or name in ("num_experts", "expert_interval", "mlp_type") else DENSE
    changed = replace(base, **MODEL_CHANGES[name])
    assert changed != base
    assert_round_trip(changed)


@pytest.mark.parametrize("name", MOE_CHANGES)
def test_a_changed_moe_field_comes_back_from_its_flags(name):
    changed = replace(MOE, moe=replace(MOE.moe, **MOE_CHANGES[name]))
    assert changed != MOE
    assert_round_trip(changed)


def test_a_dense_model_prints_no_moe_flags_and_an_moe_model_its_layout():
    dense = assert_round_trip(DENSE)
    assert not [flag for flag in dense if "moe" in flag or "expert" in flag]
    moe = assert_round_trip(MOE)
    assert moe[moe.index("--num-experts") :][:6] == [
        "--num-experts",
        "4",
        "--expert-interval",
        "2",
        "--moe-loss-coeff",
        "0.01",
    ]


@pytest.mark.parametrize(
    "spec",
    [
        TokenizerSpec("SentencePieceTokenizer", tokenizer_model="/t/tokenizer.model"),
        TokenizerSpec("GPT2BPETokenizer", vocab_file="/t/vocab.json", merge_file="/t/merges.txt"),
        TokenizerSpec("NullTokenizer", vocab_size=96),
        TokenizerSpec("NullTokenizer", vocab_size=95, null_tokenizer_eod=NULL_EOD_EXTRA),
    ],
)
def test_tokenizer_flags_name_the_same_tokenizer(spec):
    flags = tokenizer_flags(spec) + ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1"]
    assert tokenizer_spec_of(build_parser(sizing=True).parse_args(flags + ["--seq-length", "8"])) == spec
