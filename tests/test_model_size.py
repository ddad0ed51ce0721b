import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.cli.model_size import main as model_size_main
from megatron.config.flags import build_parser, model_config_from_args
from megatron.errors import ConfigError
from megatron.model import GPTModel
from megatron.model.pipeline_stage import pipeline_stage
from megatron.model.tensor_parallel import TensorParallel
from megatron.model_size import (
    GIB,
    ParameterCounts,
    RankParameters,
    check_layout,
    model_size,
    rank_memory,
    rank_parameters,
    stage_parameters,
    valid_ep_sizes,
    with_scale,
)
from megatron.placement import tensor_parallel_split
from tests.dist_utils import run_distributed

REPO = Path(__file__).resolve().parent.parent
PAPER = {
    "350M": "--num-layers 24 --hidden-size 1024 --num-attention-heads 16",
    "1.3B": "--num-layers 24 --hidden-size 2048 --num-attention-heads 16",
}
PR_350M, PR_13B = "32 " * 10 + "64 64", "64 " * 10 + "128 128"


def sized(flags: str):
    args = build_parser(sizing=True).parse_args(f"{flags} --seq-length 2048".split())
    return replace(model_config_from_args(args), vocab_size=50304)  # GPT-2's 50257, padded to 128


@pytest.mark.parametrize(
    "name, flags, published",
    [
        ("350M+MoE-128", f"{PAPER['350M']} --num-experts 128", 13e9),
        ("1.3B+MoE-128", f"{PAPER['1.3B']} --num-experts 128", 52e9),
        ("350M PR-MoE-32/64", f"{PAPER['350M']} --num-experts {PR_350M} --mlp-type residual", 4.0e9),
        ("1.3B PR-MoE-64/128", f"{PAPER['1.3B']} --num-experts {PR_13B} --mlp-type residual", 31e9),
        ("350M MoS", f"{PAPER['350M']} --num-layers 21 --num-experts {'32 ' * 8}64 64 --mlp-type residual", 3.5e9),
        ("1.3B MoS", f"{PAPER['1.3B']} --num-layers 21 --num-experts {'64 ' * 8}128 128 --mlp-type residual", 27e9),
    ],
)
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
    model_size_main(
        f"{PAPER['350M']} --num-experts 128 --seq-length 2048 --vocab-size 50257 --world-size 16 "
        "--moe-expert-parallel-size 16".split()
    )
    out = capsys.readouterr().out
    assert "total parameters: 13,1" in out and "(13.1B)\n" in out and "active parameters per token: " in out
    assert "training FLOPs per token:" in out and out.count(" *\n") == 5  # EP 16, ZeRO 0-3; the TP 1 x PP 1 layout
    assert "note:" not in out


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0"),
        (999, "999"),
        (1_234, "1,234 (1.23K)"),
        (356_000_000, "356,000,000 (356M)"),
        (999_999_999, "999,999,999 (1B)"),
        (1_234_567_890, "1,234,567,890 (1.23B)"),
        (13_149_534_208, "13,149,534,208 (13.1B)"),
        (2.7344e9, "2,734,400,000 (2.73B)"),
    ],
)
def test_numbers_read_exactly_and_at_a_glance(n, text):
    assert with_scale(n) == text


@pytest.mark.parametrize(
    "vocab_flags, vocabulary, note",
    [
        ("", "vocabulary 50,304 (padded)", "GPT-2's vocabulary of 50,257 tokens (padded to 50,304)"),
        ("--vocab-size 1000", "vocabulary 1,024 (padded)", None),
        ("--padded-vocab-size 1000", "vocabulary 1,000 (padded)", None),
        ("--tokenizer-type NullTokenizer --vocab-size 1000", "vocabulary 1,024 (padded)", None),
    ],
)
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
    cmd = [
        sys.executable,
        "pretrain_gpt.py",
        "--dry-run",
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--lr",
        "1e-3",
        "--train-iters",
        "5",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "100",
        "--data-path",
        str(tmp_path / "missing"),
        "--num-experts",
        "4",
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()

    def count(label: str) -> int:  # "total parameters: 1,234 (1.23K)" -> 1234
        return next(int(line.split(": ")[1].split(" ")[0].replace(",", "")) for line in lines if line.startswith(label))

    total, active = count("total parameters: "), count("active parameters per token: ")
    assert total > active > 0 and not (tmp_path / "missing.idx").exists()


# A tiny GPT whose parameters are counted by hand: hidden 8, 2 heads, 2 layers, 32 vocabulary rows,
# 16 positions, tied output layer. Split over TP (Megatron's column/row-parallel layout):
#   word embedding 32 x 8 = 256; per layer query_key_value 24 x 8 + 24 = 216, attention dense 8 x 8 = 64,
#   dense_h_to_4h 32 x 8 + 32 = 288, dense_4h_to_h 8 x 32 = 256: 824.
# Whole on every TP rank: position embedding 16 x 8 = 128; per layer two LayerNorms 2 x 16 and the
#   row-parallel biases 8 + 8: 48; the final LayerNorm 16.
TINY = "--num-layers 2 --hidden-size 8 --num-attention-heads 2"
EMBEDDING, POSITIONS, LAYER_SPLIT, LAYER_WHOLE, FINAL_NORM = 256, 128, 824, 48, 16


def tiny(flags: str = ""):
    args = build_parser(sizing=True).parse_args(f"{TINY} {flags} --seq-length 16".split())
    return replace(model_config_from_args(args), vocab_size=32)


def test_tiny_model_parameters_split_by_tensor_parallelism_as_counted_by_hand():
    size = model_size(tiny(), 16)
    assert size.embedding == ParameterCounts(tp_split=EMBEDDING, tp_whole=POSITIONS)
    assert size.layers == (ParameterCounts(tp_split=LAYER_SPLIT, tp_whole=LAYER_WHOLE),) * 2
    assert size.head == ParameterCounts(tp_whole=FINAL_NORM) and size.tied_output == EMBEDDING
    assert size.total == EMBEDDING + POSITIONS + 2 * (LAYER_SPLIT + LAYER_WHOLE) + FINAL_NORM == 2144
    assert rank_parameters(size) == [RankParameters(2144, 0)]
    # TP 2: half of every split tensor, the rest whole: (256 + 2 x 824) / 2 + 128 + 2 x 48 + 16
    assert rank_parameters(size, tp_size=2) == [RankParameters(952 + 240, 0)]


def test_tiny_model_pipeline_stages_hold_the_embedding_first_and_the_head_last():
    size = model_size(tiny(), 16)
    # PP 2: the first stage has the embeddings and layer 0, the last layer 1, the final norm and
    # the tied output layer's copy of the word embedding
    assert rank_parameters(size, pp_size=2) == [RankParameters(256 + 128 + 872, 0), RankParameters(872 + 16 + 256, 0)]
    # TP 2 x PP 2: (256 + 824) / 2 + 128 + 48 and (824 + 256) / 2 + 48 + 16
    assert rank_parameters(size, tp_size=2, pp_size=2) == [RankParameters(716, 0), RankParameters(604, 0)]
    memory = rank_memory(size, world_size=8, ep_size=1, zero_stage=0, tp_size=2, pp_size=2)
    assert memory.stage == 0 and memory.total == 16 * 716  # weights 4, gradients 4, Adam 8 bytes a parameter
    memory = rank_memory(size, world_size=8, ep_size=1, zero_stage=3, tp_size=2, pp_size=2)
    assert memory.total == pytest.approx(20 * 716 / 2)  # DP 2: weights, gradients, Adam and fp32 master partitioned
    untied = model_size(tiny("--untie-embeddings-and-output-weights"), 16)
    assert untied.tied_output == 0 and untied.head == ParameterCounts(tp_split=EMBEDDING, tp_whole=FINAL_NORM)
    assert rank_parameters(untied, pp_size=2)[1] == RankParameters(872 + 16 + 256, 0)


def test_moe_stage_holds_its_expert_parallel_share_of_the_experts_whole_on_each_tp_rank():
    size = model_size(tiny("--num-experts 4"), 16)  # layer 1 is MoE: 4 experts of an 8 -> 32 -> 8 MLP
    experts = 4 * (8 * 32 + 32 + 32 * 8 + 8)
    router = 4 * 8  # whole on every TP rank, like the layer's norms and the attention's dense bias
    assert size.layers[1] == ParameterCounts(
        tp_split=216 + 64, tp_whole=2 * 16 + 8 + router, expert=experts - 4 * 8, expert_tp_whole=4 * 8
    )
    # TP 2 x PP 2, EP 2: the last stage holds layer 1's attention split, its router whole and half the experts
    last = RankParameters((280 + 256) / 2 + 72 + 16, experts / 2)
    assert rank_parameters(size, tp_size=2, pp_size=2, ep_size=2) == [RankParameters(716, 0), last]
    assert last == RankParameters(356, 1104)
    for zero_stage, dense_bytes, expert_bytes in ((0, 16 * 356, 16 * 1104), (3, 20 * 356 / 2, 20 * 1104 / 2)):
        memory = rank_memory(size, world_size=8, ep_size=2, zero_stage=zero_stage, tp_size=2, pp_size=2)
        assert memory.stage == 1 and memory.total == pytest.approx(dense_bytes + expert_bytes)
    # EP 4 of a stage's 4 ranks leaves expert-DP 1: ZeRO cannot partition the experts any further
    memory = rank_memory(size, world_size=8, ep_size=4, zero_stage=3, tp_size=2, pp_size=2)
    assert memory.total == pytest.approx(20 * (356 / 2 + 552))
    assert valid_ep_sizes(tiny("--num-experts 4"), 8, pp_size=2) == [1, 2, 4]
    # expert-TP 2 halves each expert's w1, b1 and w2 (not its output bias b2) and the expert-DP group
    split_last = RankParameters(356, (experts - 4 * 8) / 4 + 4 * 8 / 2)
    assert rank_parameters(size, tp_size=2, pp_size=2, ep_size=2, expert_tp_size=2) == [
        RankParameters(716, 0),
        split_last,
    ]
    memory = rank_memory(size, world_size=8, ep_size=2, zero_stage=3, tp_size=2, pp_size=2, expert_tp_size=2)
    assert memory.total == pytest.approx(20 * (356 / 2 + split_last.expert))
    assert valid_ep_sizes(tiny("--num-experts 4"), 8, pp_size=2, expert_tp_size=2) == [1, 2]


def test_layouts_at_tp_1_and_pp_1_keep_the_earlier_results():
    size = model_size(sized(f"{PAPER['350M']} --num-experts 128"), 2048)
    assert rank_parameters(size, ep_size=8) == [RankParameters(size.dense, size.expert / 8)]
    for stage in (0, 1, 2, 3):
        assert rank_memory(size, 16, 8, stage) == rank_memory(size, 16, 8, stage, tp_size=1, pp_size=1)
    # every parameter is on one stage, but for the last stage's copy of the tied word embedding
    for pp in (2, 4, 8):
        stages = stage_parameters(size, pp)
        assert sum(s.tp_split + s.tp_whole for s in stages) == size.dense + size.tied_output
        assert sum(s.expert + s.expert_tp_whole for s in stages) == size.expert


def test_uneven_first_and_last_stages_take_the_layers_megatron_gives_them():
    size = model_size(sized(PAPER["350M"]), 2048)
    layer = size.layers[0]  # every layer of the dense model is alike
    stages = stage_parameters(size, 4, first_stage_layers=5, last_stage_layers=7)  # 5, 6, 6, 7 layers
    assert stages[0] == size.embedding + sum((layer,) * 5, ParameterCounts())
    assert stages[1] == stages[2] == sum((layer,) * 6, ParameterCounts())
    assert stages[3] == sum((layer,) * 7, ParameterCounts()) + size.head + ParameterCounts(tp_split=size.tied_output)
    memory = rank_memory(size, 8, 1, 0, pp_size=4, first_stage_layers=5, last_stage_layers=7)
    assert memory.stage == 3 and memory.total == 16 * (stages[3].tp_split + stages[3].tp_whole)


@pytest.mark.parametrize(
    "flags",
    ["", "--untie-embeddings-and-output-weights --position-embedding-type rope", "--num-experts 4 --mlp-type residual"],
)
@pytest.mark.parametrize("pp, first", [(2, None), (2, 1), (4, None)])
def test_stages_hold_what_the_pipeline_stage_model_holds(flags, pp, first):
    config = tiny(f"{flags} --num-layers 4")
    stages = stage_parameters(model_size(config, 16), pp, first_stage_layers=first)
    for rank, stage in enumerate(stages):
        with torch.device("meta"):
            model = GPTModel(config, stage=pipeline_stage(4, pp, rank, first))
        assert (
            sum(p.numel() for p in model.parameters())
            == stage.tp_split + stage.tp_whole + stage.expert + stage.expert_tp_whole
        ), rank


@pytest.mark.parametrize(
    "sizes, message",
    [
        (
            dict(tp_size=3),
            "--tensor-model-parallel-size 3 x --pipeline-model-parallel-size 1 does not divide the 8 ranks",
        ),
        (dict(tp_size=4), "--num-attention-heads 2 cannot be split over --tensor-model-parallel-size 4"),
        (dict(pp_size=4), "--num-layers 2 cannot be split over --pipeline-model-parallel-size 4"),
        (
            dict(pp_size=2, ep_size=8),
            "--moe-expert-parallel-size 8 x --expert-tensor-parallel-size 1 does not divide "
            "the 4 ranks of a pipeline stage",
        ),
        (dict(ep_size=8), "4 experts cannot be split over --moe-expert-parallel-size 8"),
    ],
)
def test_layouts_that_do_not_divide_are_refused_with_one_sentence(sizes, message):
    with pytest.raises(ConfigError, match=message):
        check_layout(tiny("--num-experts 4"), 8, **sizes)


def _local_parameters_on_rank() -> dict[str, torch.Tensor]:
    """This TP rank's parameter counts, split and whole, of the real tensor-parallel model."""
    group = dist.new_group([0, 1])
    out = {}
    for case, flags in TP_CASES.items():
        with torch.device("meta"):  # the experts split over the same ranks in the expert-TP case
            model = GPTModel(tiny(flags), tp=TensorParallel(group, True, group if case == "expert_tp" else None))
        for kind, split in (("split", True), ("whole", False)):
            out[f"{case}/{kind}"] = torch.tensor(
                sum(p.numel() for p in model.parameters() if (tensor_parallel_split(p) is not None) == split)
            )
    return out


TP_CASES = {
    "classic": "",
    "modern": "--swiglu --group-query-attention --num-query-groups 2 --normalization RMSNorm --qk-layernorm "
    "--disable-bias-linear --untie-embeddings-and-output-weights --position-embedding-type rope",
    "pr_moe": "--num-experts 4 --mlp-type residual",
    "shared_experts": "--num-experts 4 --moe-shared-expert-intermediate-size 16 --moe-shared-expert-gate",
    "expert_tp": "--num-experts 4 --swiglu",
}


def test_sizing_splits_what_the_tensor_parallel_model_splits():
    ranks = run_distributed(_local_parameters_on_rank, 2)
    for case, flags in TP_CASES.items():
        size = model_size(tiny(flags), 16)
        counts = sum((*size.layers, size.embedding, size.head), ParameterCounts())
        for rank in ranks:
            split_experts, whole_experts = (counts.expert, 0) if case == "expert_tp" else (0, counts.expert)
            assert (rank[f"{case}/split"].item(), rank[f"{case}/whole"].item()) == (
                counts.tp_split / 2 + split_experts / 2,
                counts.tp_whole + whole_experts + counts.expert_tp_whole,
            ), case


def test_model_size_tool_prints_memory_for_every_layout(capsys):
    model_size_main(
        f"{PAPER['350M']} --seq-length 2048 --vocab-size 50257 --world-size 8 "
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --zero-stage 1".split()
    )
    lines = capsys.readouterr().out.splitlines()
    assert "vocabulary 50,432 (padded)" in lines[0]  # padded to 128 x TP 2, as training pads it
    assert "on 8 rank(s) as TP 2 x DP 2 x PP 2" in lines[4] and lines[5].split()[-1] == "stage"
    start = next(i for i, line in enumerate(lines) if line.startswith("memory per rank in GiB for each layout"))
    assert "of 8 rank(s) at ZeRO stage 1 and EP size 1" in lines[start]
    assert lines[start + 1].split() == [
        "TP",
        "PP",
        "DP",
        "EP-DP",
        "stage",
        "weights",
        "gradients",
        "optimizer",
        "total",
    ]
    rows = [line.split() for line in lines[start + 2 :]]
    # 16 heads and 24 layers: every TP x PP that divides 8 ranks
    assert [(int(r[0]), int(r[1]), int(r[2])) for r in rows] == [
        (1, 1, 8),
        (1, 2, 4),
        (1, 4, 2),
        (1, 8, 1),
        (2, 1, 4),
        (2, 2, 2),
        (2, 4, 1),
        (4, 1, 2),
        (4, 2, 1),
        (8, 1, 1),
    ]
    assert [r[-1] for r in rows].count("*") == 1 and rows[5][-1] == "*"
    size = model_size(replace(sized(PAPER["350M"]), vocab_size=50432), 2048)
    memory = rank_memory(size, 8, 1, 1, tp_size=2, pp_size=2)
    assert rows[5][4:9] == [
        str(memory.stage),
        *(f"{b / GIB:.2f}" for b in (memory.weights, memory.gradients, memory.optimizer, memory.total)),
    ]


def test_model_size_tool_refuses_a_layout_that_does_not_divide(capsys):
    with pytest.raises(SystemExit) as exit_info:
        model_size_main(f"{PAPER['350M']} --seq-length 2048 --world-size 8 --tensor-model-parallel-size 3".split())
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == (
        "error: --tensor-model-parallel-size 3 x --pipeline-model-parallel-size 1 does "
        "not divide the 8 ranks; choose sizes whose product divides the number of processes\n"
    )


def test_a_dry_run_with_async_save_counts_the_host_copy_of_a_checkpoint(tmp_path):
    """The copy holds what the rank saves: the weights and optimizer columns of this run's row."""
    flags = "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --micro-batch-size 1 "
    flags += "--lr 1e-4 --train-iters 5 --tokenizer-type NullTokenizer --vocab-size 50000 --async-save --save ckpt"
    command = [sys.executable, "pretrain_gpt.py", "--dry-run", *flags.split(), "--data-path", str(tmp_path / "none")]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    row = next(line.split() for line in lines if line.split()[:2] == ["1", "0"] and line.endswith("*"))
    weights, optimizer = float(row[2]), float(row[4])  # EP size, ZeRO stage, weights, gradients, optimizer, total
    copy = next(line for line in lines if line.startswith("--async-save: up to "))
    assert float(copy.split()[3]) == pytest.approx(weights + optimizer, abs=0.011) and weights > 1
