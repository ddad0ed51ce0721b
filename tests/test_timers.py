"""Megatron's timers: `--timing-log-level 0|1|2` and `--timing-log-option max|minmax|all`. Every
part of an iteration named in the issue is timed at its level and logged across ranks; timers on
or off, a run's losses are the same to the bit; at level 0 none is installed at all."""

import json

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron.config.flags import parse_args, with_data_parallel_size
from megatron.parallel import build_parallel_grid
from megatron.timers import INSTALLED, LEVELS, OFF, TimerReading, Timers, timed, untimed
from megatron.training.loop import Trainer
from megatron.training.step import forward_step
from tests.dist_utils import run_distributed
from tests.training_fixtures import moe_layout_flags, write_corpus


def test_nothing_installed_or_above_the_level_is_the_shared_empty_context():
    assert timed("forward-backward") is OFF
    with Timers(1).recording():
        assert timed("forward-compute") is OFF  # a level-2 timer
        assert timed("forward-backward") is not OFF
        with untimed():
            assert timed("forward-backward") is OFF
    assert INSTALLED.value is None


def test_nested_starts_of_one_timer_count_once_and_save_is_the_intervals_total():
    timers = Timers(2, "minmax")
    with timers.recording():
        for _ in range(2):
            with timed("optimizer"), timed("optimizer"):
                pass
        with timed("save-checkpoint"):
            pass
    outer = timers.timers["optimizer"].elapsed_s
    saved = timers.timers["save-checkpoint"].elapsed_s
    readings = {r.name: r for r in timers.readings(iterations=4)}
    assert set(readings) == {"optimizer", "save-checkpoint"}  # only what ran
    assert readings["optimizer"].ms_per_rank == [pytest.approx(1000 * outer / 4)]
    assert readings["save-checkpoint"].ms_per_rank == [pytest.approx(1000 * saved)]
    assert timers.timers["optimizer"].elapsed_s == 0.0  # read and reset


def test_the_three_log_options_print_megatrons_blocks():
    timers = Timers(1, "minmax")
    readings = [TimerReading("forward-backward", [10.0, 12.5]), TimerReading("optimizer", [1.0, 2.0])]
    minmax = timers.log_text(readings).splitlines()
    assert minmax[0] == "(min, max) time across ranks (ms):"
    assert minmax[1].startswith("    forward-backward ....") and minmax[1].endswith(": (10.00, 12.50)")
    timers.log_option = "max"
    assert timers.log_text(readings).splitlines()[2].endswith(": 2.00")
    timers.log_option = "all"
    assert timers.log_text(readings).splitlines()[:4] == [
        "times across ranks (ms):",
        "  forward-backward:",
        "     rank  0: 10.00",
        "     rank  1: 12.50",
    ]


def _losses_and_timers(corpus: str, level: int, option: str, layout: str, swap_dir: str) -> dict[str, torch.Tensor]:
    pp, ep = (2, 1) if layout == "pp2" else (1, 2)
    grid = build_parallel_grid(torch.device("cpu"), pp_size=pp, ep_size=ep)
    flags = moe_layout_flags(
        corpus, pp, ep, train_iters=4, log_interval=2, timing_log_level=level, timing_log_option=option,
        tensorboard_dir=f"{swap_dir}/tb{level}" if grid.rank == 0 else None, log_timers_to_tensorboard=True,
    )  # fmt: skip
    if layout == "ep2-zero3-nvme":
        path = f"{swap_dir}/ds_{level}.json"
        zero = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": f"{swap_dir}/swap{level}"}}
        with open(path, "w") as file:
            json.dump({"zero_optimization": zero}, file)
        flags += ["--deepspeed", "--deepspeed_config", path]
    installed = []

    def forward(engine, *args, **kwargs):
        if engine.module.training:  # evaluation is untimed
            installed.append(INSTALLED.value is not None)
        return forward_step(engine, *args, **kwargs)

    config = with_data_parallel_size(parse_args(flags), grid.dp_size)
    result = Trainer(config, grid, forward=forward).train()
    return {"losses": torch.tensor(result.losses, dtype=torch.float64), "installed": torch.tensor(installed)}


@pytest.mark.parametrize(
    "layout, option, expected",
    [
        (
            "pp2",
            "all",
            {"forward-recv", "backward-send", "forward-send-backward-recv", "pipeline-bubble", "forward-compute"},
        ),
        (
            "ep2-zero3-nvme",
            "minmax",
            {
                "moe-dispatch-all-to-all",
                "moe-combine-all-to-all",
                "params-all-gather",
                "nvme-swap-read",
                "nvme-swap-write",
                "all-grads-sync",
                "optimizer",
                "batch-generator",
            },
        ),
    ],
)
def test_timers_on_and_off_give_the_same_losses_and_log_every_part(tmp_path, capfd, layout, option, expected):
    corpus = write_corpus(tmp_path)
    off = run_distributed(_losses_and_timers, 2, corpus, 0, "minmax", layout, str(tmp_path))
    capfd.readouterr()
    on = run_distributed(_losses_and_timers, 2, corpus, 2, option, layout, str(tmp_path))
    printed = capfd.readouterr().out
    for rank_off, rank_on in zip(off, on):
        assert torch.equal(rank_off["losses"], rank_on["losses"])
        assert not rank_off["installed"].any() and rank_on["installed"].all()
    header = "times across ranks (ms):" if option == "all" else "(min, max) time across ranks (ms):"
    assert printed.count(header) == 2  # at each of the two log lines, by the first rank only
    logged = {name for name in LEVELS if f"    {name} ." in printed or f"  {name}:" in printed}
    assert expected <= logged, expected - logged
    if option == "all":
        assert "     rank  1: " in printed
    scalars = EventAccumulator(str(tmp_path / "tb2")).Reload().Tags()["scalars"]
    assert {f"{name}-time" for name in expected} <= set(scalars)  # --log-timers-to-tensorboard
