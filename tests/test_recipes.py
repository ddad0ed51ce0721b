"""The MoE recipes: each is run in DRY_RUN mode with PYTHON=echo, so the script writes its ds_config
and prints the pretrain_gpt.py command it would run; the command is then parsed and checked here."""

import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest

from megatron.config.flags import parse_args, with_data_parallel_size

RECIPES = Path(__file__).resolve().parent.parent / "examples_deepspeed" / "MoE"
PAPER = {
    "ds_pretrain_gpt_125M_MoE64.sh": (12, 768, 256, [64] * 6),
    "ds_pretrain_gpt_350M_dense.sh": (24, 1024, 256, [1]),
    "ds_pretrain_gpt_350M_MoE128.sh": (24, 1024, 256, [128] * 12),
    "ds_pretrain_gpt_1.3B_dense.sh": (24, 2048, 512, [1]),
    "ds_pretrain_gpt_1.3B_MoE128.sh": (24, 2048, 512, [128] * 12),
    "ds_pretrain_gpt_350M_PR-MoE32or64.sh": (24, 1024, 256, [32] * 10 + [64] * 2),
    "ds_pretrain_gpt_1.3B_PR-MoE64or128.sh": (24, 2048, 512, [64] * 10 + [128] * 2),
    "ds_pretrain_gpt_350M_PR-MoE32or64_MoS.sh": (21, 1024, 256, [32] * 8 + [64] * 2),
    "ds_pretrain_gpt_1.3B_PR-MoE64or128_MoS.sh": (21, 2048, 512, [64] * 8 + [128] * 2),
}
TINY = sorted(p.name for p in RECIPES.glob("ds_pretrain_gpt_tiny_*_cpu.sh"))


def printed_run(recipe: str, tmp_path: Path, **env: str):
    """(world size, parsed config, ds_config dict) of the run `recipe` would start."""
    demo = tmp_path / "demo"
    demo.mkdir(exist_ok=True)
    for name in ("corpus_text_document.idx", "tokenizer.model"):  # the tiny recipes check these exist
        (demo / name).write_text("x")
    full_env = {
        **os.environ,
        "DRY_RUN": "1",
        "PYTHON": "echo",
        "OUTPUT_DIR": str(tmp_path / "out"),
        "DEMO_DIR": str(demo),
        **env,
    }
    done = subprocess.run(["bash", str(RECIPES / recipe)], env=full_env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    header, command = done.stdout.strip().splitlines()
    world = int(re.search(r": (\d+) rank", header).group(1))
    config_path = Path(re.search(r"ds_config (\S+)", header).group(1))
    text = config_path.read_text()
    assert not re.search(r"CONFIG_|TEMPLATE|\$\{|\$[A-Z]", text), text  # no placeholder left
    argv = command.split()
    assert argv[0] == "pretrain_gpt.py" and argv[-1] == "--dry-run"
    return world, parse_args(argv[1:]), json.loads(text)


@pytest.mark.parametrize("recipe", sorted(PAPER))
def test_paper_recipes_carry_the_published_settings(recipe, tmp_path):
    world, config, ds = printed_run(recipe, tmp_path, NNODES="8", GPUS_PER_NODE="8")
    layers, hidden, batch, experts = PAPER[recipe]
    m, t = config.model, config.training
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, t.seq_length) == (
        layers,
        hidden,
        16 if hidden > 768 else 12,
        2048,
    )
    assert [c for c in m.experts_per_layer if c > 1] == [c for c in experts if c > 1]
    assert m.mlp_type == ("residual" if "PR-MoE" in recipe else "standard") and m.moe.topk == 1
    assert (m.moe.train_capacity_factor, m.moe.min_capacity, m.moe.aux_loss_coeff) == (1.0, 4, 0.01)
    r = config.runtime_config(world)
    assert (r.optimizer.params.betas, r.optimizer.params.weight_decay, r.gradient_clipping, r.precision) == (
        (0.9, 0.95),
        0.1,
        1.0,
        "fp16",
    )
    assert (t.global_batch_size, t.lr_warmup_tokens, t.lr_decay_tokens) == (batch, 375_000_000, 300_000_000_000)
    assert t.train_iters == math.ceil(300e9 / (batch * 2048)) and t.lr_decay_style == "cosine"
    assert ds["train_batch_size"] == batch and ds["fp16"]["enabled"] is True and ds["bf16"]["enabled"] is False
    # the EP size divides the world and every layer's expert count, the teacher's included
    ep = t.expert_parallel_size
    teacher = config.distill.teacher.num_experts if config.distill else ()
    assert world % ep == 0 and all(c % ep == 0 for c in [*experts, *teacher] if c > 1)
    assert ep == (1 if experts == [1] else math.gcd(world, *experts, *teacher))
    with_data_parallel_size(config, world)  # batch sizes, EP and the DeepSpeed JSON agree


def test_mos_recipes_distil_from_their_pr_moe_teacher_with_staged_kd(tmp_path):
    _, config, _ = printed_run("ds_pretrain_gpt_350M_PR-MoE32or64_MoS.sh", tmp_path, NNODES="2", GPUS_PER_NODE="8")
    d = config.distill
    assert d.kd and d.load_teacher.endswith("checkpoint/gpt-350M-PR-MoE32or64") and (d.alpha_ce, d.beta_ce) == (1, 1)
    assert (d.teacher.num_layers, d.teacher.num_experts, d.teacher.mlp_type) == (24, (32,) * 10 + (64, 64), "residual")
    assert d.stop_iteration == math.ceil(0.6 * 300e9 / (256 * 2048))  # KD for the first 60% of training
    assert config.training.expert_parallel_size == 16  # 16 ranks: divides 32 and 64
    _, no_kd, _ = printed_run("ds_pretrain_gpt_350M_PR-MoE32or64_MoS.sh", tmp_path, MOS_KD="0")
    assert no_kd.distill is None


@pytest.mark.parametrize("recipe", TINY)
def test_tiny_cpu_recipes_run_on_one_process_with_the_demo_data(recipe, tmp_path):
    world, config, ds = printed_run(recipe, tmp_path)
    assert world == 1 and config.runtime_config(1).precision == "fp32" and ds["zero_optimization"]["stage"] == 0
    assert config.data.tokenizer_type == "SentencePieceTokenizer" and config.data.data_path[0].endswith(
        "corpus_text_document"
    )
    assert config.model.is_moe == ("dense" not in recipe) and (config.distill is not None) == ("MoS" in recipe)
    with_data_parallel_size(config, world)


def test_modern_recipe_builds_todays_moe_architecture(tmp_path):
    _, config, _ = printed_run("ds_pretrain_gpt_tiny_modern_MoE_cpu.sh", tmp_path)
    m, moe = config.model, config.model.moe
    assert m.swiglu and m.normalization == "RMSNorm" and not m.add_bias_linear and m.untie_embeddings_and_output_weights
    assert m.num_query_groups == 2 and m.position_embedding_type == "rope" and m.experts_per_layer == [16] * 8
    assert (m.moe_ffn_hidden_size, m.moe_shared_expert_intermediate_size, moe.topk) == (32, 32, 4)
    assert moe.score_function == "sigmoid" and moe.router_enable_expert_bias and not moe.drop_tokens
    assert moe.router_load_balancing_type == "seq_aux_loss" and moe.aux_loss_coeff == 1e-4


def test_every_recipe_sources_the_one_settings_file():
    scripts = sorted(RECIPES.glob("ds_pretrain_gpt_*.sh"))
    assert {p.name for p in scripts} == set(PAPER) | set(TINY) and len(TINY) == 5
    for script in scripts:
        text = script.read_text()
        assert 'source "$(dirname "$0")/recipe_settings.sh"' in text and "run_recipe " in text
        assert len(text.splitlines()) < 15, (
            f"{script.name} should hold its model only; shared settings go in recipe_settings.sh"
        )


def test_offload_setting_writes_the_offload_blocks_the_runtime_accepts(tmp_path):
    _, config, ds = printed_run("ds_pretrain_gpt_tiny_MoE_cpu.sh", tmp_path, OFFLOAD="nvme", ZERO_STAGE="3")
    zero = config.runtime_config(1).zero_optimization
    assert ds["zero_optimization"]["stage"] == zero.stage == 3  # --zero-stage and the JSON agree, or parsing refused
    assert zero.offload_optimizer.device == zero.offload_param.device == "nvme" and zero.offload_param.max_in_cpu == 0
    assert zero.offload_param.nvme_path == zero.offload_optimizer.nvme_path == str(tmp_path / "out" / "swap")
    _, config, _ = printed_run("ds_pretrain_gpt_tiny_MoE_cpu.sh", tmp_path, OFFLOAD="cpu", ZERO_STAGE="2")
    zero = config.runtime_config(1).zero_optimization
    assert (zero.stage, zero.offload_optimizer.device, zero.offload_param.device) == (2, "cpu", "none")
    _, config, _ = printed_run("ds_pretrain_gpt_tiny_MoE_cpu.sh", tmp_path)  # tiny recipes: no ZeRO unless asked
    zero = config.runtime_config(1).zero_optimization
    assert zero.stage == 0 and zero.offload_optimizer.device == "none"
    done = subprocess.run(
        ["bash", str(RECIPES / "ds_pretrain_gpt_tiny_MoE_cpu.sh")],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "DRY_RUN": "1",
            "PYTHON": "echo",
            "OUTPUT_DIR": str(tmp_path / "out"),
            "DEMO_DIR": str(tmp_path / "demo"),
            "OFFLOAD": "disk",
        },
        timeout=60,
    )
    assert done.returncode != 0 and "OFFLOAD=disk; use none, cpu or nvme" in done.stderr
