"""The ds_config `flops_profiler` block under pipeline and expert parallelism: each rank profiles
its own modules and the first rank's profile lists every rank's part, their sum and the slowest
rank. The two pipeline stages' forward FLOPs add up to one process's for the same step."""

import json
import re

import pytest
import torch

from megatron.config.flags import parse_args, with_data_parallel_size
from megatron.parallel import build_parallel_grid
from megatron.profiling.report import _PREFIXES
from megatron.training.loop import Trainer
from tests.dist_utils import run_distributed
from tests.training_fixtures import moe_layout_flags, write_corpus

SCALE = dict(_PREFIXES)


def _profiled(corpus: str, folder: str, pp: int, ep: int) -> dict[str, torch.Tensor]:
    grid = build_parallel_grid(torch.device("cpu"), pp_size=pp, ep_size=ep)
    ds_config = f"{folder}/ds_{pp}_{ep}.json"
    profile = f"{folder}/profile_{pp}_{ep}.txt"
    if grid.rank == 0:
        with open(ds_config, "w") as file:
            json.dump({"flops_profiler": {"enabled": True, "profile_step": 1, "output_file": profile}}, file)
    grid.barrier()
    flags = moe_layout_flags(corpus, pp, ep, global_batch_size=4 if ep == 1 else 8, train_iters=3)
    config = with_data_parallel_size(parse_args(flags + ["--deepspeed", "--deepspeed_config", ds_config]), grid.dp_size)
    Trainer(config, grid).train()
    return {}


def _number(text: str) -> float:
    value, _, prefix = text.partition(" ")
    return float(value) * SCALE.get(prefix.strip(), 1)


def _fwd_flops(text: str) -> float:
    return _number(re.search(r"^fwd FLOPs: +(.+)$", text, re.M).group(1))


def _rank_rows(text: str) -> dict[str, list[str]]:
    block = text.split("Every rank's part", 1)[1].split("\n\n", 1)[0]
    return {line.split()[0]: re.split(r"\s{2,}", line.strip())[1:] for line in block.splitlines()[2:]}


@pytest.mark.parametrize("layout", ["pp2", "ep2"])
def test_the_first_rank_prints_every_ranks_part_their_sum_and_the_slowest(tmp_path, layout):
    corpus = write_corpus(tmp_path)
    pp, ep = (2, 1) if layout == "pp2" else (1, 2)
    run_distributed(_profiled, 2, corpus, str(tmp_path), pp, ep)
    text = (tmp_path / f"profile_{pp}_{ep}.txt").read_text()
    rows = _rank_rows(text)
    assert set(rows) == {"0", "1", "sum", "slowest"}
    flops = [_number(rows[r][1]) for r in ("0", "1")]
    assert _number(rows["sum"][1]) == pytest.approx(sum(flops), rel=0.01)
    assert _fwd_flops(text) == pytest.approx(flops[0], rel=0.01)  # the summary above is the first rank's
    assert re.search(r"slowest rank: [01], iteration [0-9.]+ [mu]?s \([0-9.]+% above the fastest, rank [01]\)", text)
    if layout == "pp2":  # the stages' parts add up to the whole model's forward of the same step
        run_distributed(_profiled, 1, corpus, str(tmp_path), 1, 1)
        whole = _fwd_flops((tmp_path / "profile_1_1.txt").read_text())
        assert sum(flops) == pytest.approx(whole, rel=0.01)
        assert flops[1] > flops[0]  # the last stage holds the output layer
