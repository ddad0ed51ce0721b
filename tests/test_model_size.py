import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from megatron.config.flags import build_parser, model_config_from_args
from megatron.model_size import model_size, rank_memory, valid_ep_sizes, with_scale
from megatron.model_size import main as model_size_main

REPO = Path(__file__).resolve().parent.parent
PAPER = {"350M": "--num-layers 24 --hidden-size 1024 --num-attention-heads 16",
         "1.3B": "--num-layers 24 --hidden-size 2048 --num-attention-heads 16"}
PR_350M, PR_13B = "32 " * 10 + "64 64", "64 " * 10 + "128 128"


def sized(flags: str):
    args = build_parser(sizing=True).parse_args(f"{flags} --seq-length 2048".split())
    return replace(model_config_from_args(args), vocab_size=50304)  # GPT-2's 50257, padded to 128


@pytest.mark.parametrize("name, flags, published", [
    ("350M+MoE-128", f"{PAPER['350M']} --num-experts 128", 13e9),
    ("1.3B+MoE-128", f"{PAPER['1.3B']} --num-experts 128", 52e9),
    ("350M PR-MoE-32/64", f"{PAPER['350M']} --num-experts {PR_350M} --mlp-type residual", 4.0e9),
    ("1.3B PR-MoE-64/128", f"{PAPER['1.3B']} --num-experts {PR_13B} --mlp-type residual", 31e9),
    ("350M MoS", f"{PAPER['350M']} --num-layers 21 --num-experts {'32 ' * 8}64 64 --mlp-type residual", 3.5e9),
    ("1.3B MoS", f"{PAPER['1.3B']} --num-layers 21 --num-experts {'64 ' * 8}128 128 --mlp-type residual", 27e9),
])
def test_paper_model_sizes(name, flags, published):
    size = model_size(sized(flags), 2048)
    assert abs(size.total - published) / published < 0.05, (name, size.total)
    assert size.active < size.total / 5  # top-1: one expert of many per token


def test_active_parameters_count_k_experts_and_everything_dense():
    dense = model_size(sized(PAPER["350M"]), 2048)
    assert dense.active == dense.total == dense.dense and 3.4e8 < dense.total < 3.7e8
    moe = model_size(sized(f"{PAPER['350M']} --num-experts 128"), 2048)
    expert_mlp = 2 * 1024 * 4096 + 4096 + 1024  # one expert's weights and biases
    router = 1024 * 128
    # each of the 12 MoE layers: 127 of 128 experts idle; the router is active
    assert moe.total - moe.active == 12 * 127 * expert_mlp
    assert moe.active == dense.total + 12 * router


def test_memory_per_rank_follows_the_zero_stage_and_expert_parallel_size():
    size = model_size(sized(f"{PAPER['350M']} --num-experts 128"), 2048)
    per_rank = size.dense + size.expert / 8
    stage0 = rank_memory(size, world_size=8, ep_size=8, zero_stage=0)
    assert (stage0.weights, stage0.gradients, stage0.optimizer) == (4 * per_rank, 4 * per_rank, 8 * per_rank)
    stage3 = rank_memory(size, world_size=8, ep_size=8, zero_stage=3)
    shard = size.dense / 8 + size.expert / 8 / 1  # experts: EP 8 over 8 ranks leaves expert-DP 1
    assert stage3.weights == pytest.approx(4 * shard) and stage3.optimizer == pytest.approx(12 * shard)
    assert valid_ep_sizes(sized(f"{PAPER['350M']} --num-experts {PR_350M}"), 64) == [1, 2, 4, 8, 16, 32]


def test_model_size_tool_prints_the_named_lines(capsys):
    model_size_main(f"{PAPER['350M']} --num-experts 128 --seq-length 2048 --vocab-size 50257 --world-size 16 "
                    "--moe-expert-parallel-size 16".split())
    out = capsys.readouterr().out
    assert "total parameters: 13,1" in out and "(13.1B)\n" in out and "active parameters per token: " in out
    assert "training FLOPs per token:" in out and out.count(" *\n") == 4  # EP 16, ZeRO 0-3
    assert "note:" not in out


@pytest.mark.parametrize("n, text", [
    (0, "0"), (999, "999"), (1_234, "1,234 (1.23K)"), (356_000_000, "356,000,000 (356M)"),
    (999_999_999, "999,999,999 (1B)"), (1_234_567_890, "1,234,567,890 (1.23B)"),
    (13_149_534_208, "13,149,534,208 (13.1B)"), (2.7344e9, "2,734,400,000 (2.73B)"),
])
def test_numbers_read_exactly_and_at_a_glance(n, text):
    assert with_scale(n) == text


@pytest.mark.parametrize("vocab_flags, vocabulary, note", [
    ("", "vocabulary 50,304 (padded)", "GPT-2's vocabulary of 50,257 tokens (padded to 50,304)"),
    ("--vocab-size 1000", "vocabulary 1,024 (padded)", None),
    ("--padded-vocab-size 1000", "vocabulary 1,000 (padded)", None),
    ("--tokenizer-type NullTokenizer --vocab-size 1000", "vocabulary 1,024 (padded)", None),
])
def test_model_size_tool_needs_no_tokenizer(vocab_flags, vocabulary, note, capsys):
    model_size_main(f"{PAPER['350M']} --seq-length 2048 {vocab_flags}".split())
    lines = capsys.readouterr().out.splitlines()
    assert vocabulary in lines[1 if note else 0]
    assert (note in lines[0] and lines[0].startswith("note: ")) if note else not lines[0].startswith("note")


def test_model_size_help_describes_the_tool(capsys):
    with pytest.raises(SystemExit) as exit_info:
        model_size_main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out.startswith("usage: tools/model_size.py ")
    assert "Size a GPT model" in out and "Pretrain a GPT model" not in out and "--padded-vocab-size" in out


def test_pretrain_dry_run_checks_the_flags_and_sizes_without_data(tmp_path):
    cmd = [sys.executable, "pretrain_gpt.py", "--dry-run", "--num-layers", "2", "--hidden-size", "32",
           "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2", "--lr", "1e-3",
           "--train-iters", "5", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
           "--data-path", str(tmp_path / "missing"), "--num-experts", "4"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    def count(label: str) -> int:  # "total parameters: 1,234 (1.23K)" -> 1234
        return next(int(line.split(": ")[1].split(" ")[0].replace(",", "")) for line in lines if line.startswith(label))
    total, active = count("total parameters: "), count("active parameters per token: ")
    assert total > active > 0 and not (tmp_path / "missing.idx").exists()
