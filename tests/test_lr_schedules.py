"""DeepSpeed-style LR schedules against their formulas, written out again here independently."""

import json
import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import pytest
import torch

from megatron.errors import ConfigError
from megatron.parallel import single_process_grid
from megatron.runtime import initialize
from megatron.runtime.lr_schedules import SCHEDULES, AnnealingLR, build_scheduler
from megatron.runtime.schedule_resume import restore_schedule

W, T = 10, 50
TS = [-1, 0, 1, 2, W - 2, W - 1, W, W + 1, 25, T - 1, T, T + 1, T + 20]


def adam(lr: float = 0.5, groups: int = 1) -> torch.optim.Optimizer:
    params = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr * (g + 1)} for g in range(groups)]
    return torch.optim.Adam(params, lr=lr)


def values_at(type_name: str, params: dict[str, Any], ts: list[int], groups: int = 1) -> list[list[float]]:
    """The lr of every group at each t, reached by stepping (t = -1 is the construction value)."""
    optimizer = adam(groups=groups)
    schedule = build_scheduler(optimizer, type_name, params)
    seen: dict[int, list[float]] = {}
    for t in range(-1, max(ts) + 1):
        assert schedule.last_batch_iteration == t
        seen[t] = [group["lr"] for group in optimizer.param_groups]
        assert schedule.get_last_lr() == seen[t] == schedule.get_lr()
        schedule.step()
    return [seen[t] for t in ts]


def check(type_name: str, params: dict[str, Any], expected: Callable[[int, float], float], groups: int = 1) -> None:
    got = values_at(type_name, params, TS, groups)
    base = [0.5 * (g + 1) for g in range(groups)]
    assert got == [pytest.approx([expected(t, b) for b in base], abs=1e-12) for t in TS]


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase: bool) -> None:
    params = {
        "lr_range_test_min_lr": 1e-3,
        "lr_range_test_step_size": 4,
        "lr_range_test_step_rate": 2.0,
        "lr_range_test_staircase": staircase,
    }

    def lr(t: int, _: float) -> float:
        interval = (t + 1) / 4
        return 1e-3 * (1 + 2.0 * (math.floor(interval) if staircase else interval))

    check("LRRangeTest", params, lr)


def warm(t: int, warmup_type: str) -> float:
    w = max(2, W)
    return math.log(t + 1) / math.log(w) if warmup_type == "log" else t / w


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_lr(warmup_type: str) -> None:
    params = {"warmup_min_lr": 0.01, "warmup_max_lr": 0.2, "warmup_num_steps": W, "warmup_type": warmup_type}

    def lr(t: int, _: float) -> float:
        gamma = 0.0 if t < 0 else warm(t, warmup_type) if t < W else 1.0
        return 0.01 + 0.19 * gamma

    check("WarmupLR", params, lr)


def test_warmup_lr_defaults_to_each_groups_lr_and_tiny_warmup_is_two() -> None:
    check("WarmupLR", {"warmup_num_steps": W}, lambda t, b: 0.0 if t < 0 else b * (warm(t, "log") if t < W else 1), 2)
    got = values_at("WarmupLR", {"warmup_num_steps": 1, "warmup_type": "linear"}, [0, 1, 2])
    assert got == [[0.0], [0.25], [0.5]]  # W = max(2, 1)


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_decay_lr(warmup_type: str) -> None:
    params = {
        "total_num_steps": T,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.1,
        "warmup_num_steps": W,
        "warmup_type": warmup_type,
    }

    def lr(t: int, _: float) -> float:
        if t < 0:
            return 0.0
        gamma = warm(t, warmup_type) if t < W else max(0.0, (T - t) / max(1, T - W))
        return 0.1 * gamma

    check("WarmupDecayLR", params, lr)


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_cosine_lr_is_a_ratio_of_each_groups_lr(warmup_type: str) -> None:
    params = {
        "total_num_steps": T,
        "warmup_min_ratio": 0.1,
        "warmup_num_steps": W,
        "cos_min_ratio": 0.05,
        "warmup_type": warmup_type,
    }

    def lr(t: int, base: float) -> float:
        if t < 0:
            return 0.0
        if t < W:
            return base * (0.1 + 0.9 * warm(t, warmup_type))
        p = min(1.0, (t - W + 1) / max(1, T - W))
        return base * max(0.0, 0.05 + 0.95 * (1 + math.cos(math.pi * p)) / 2)

    check("WarmupCosineLR", params, lr, groups=2)


def one_cycle(t: int, s1: int, s2: int, stairs: tuple[int, int] = (0, 0)) -> float:
    """The cycle's scale in [0, 1] at t (issue 5's formula, exact in fractions; a stair count
    floors the scale of its half to multiples of 1/count)."""
    size, b = s1 + s2, t + 1
    x = 1 + Fraction(b, size) - math.floor(1 + Fraction(b, size))
    r = Fraction(s1, size)
    scale, count = (x / r, stairs[0]) if x <= r else ((x - 1) / (r - 1), stairs[1])
    return float(Fraction(math.floor(scale * count), count) if count else scale)


@pytest.mark.parametrize("stairs", [(0, 0), (2, 3)])
def test_one_cycle_lr_and_momentum(stairs: tuple[int, int]) -> None:
    s1, s2, dss = 6, 12, 5
    optimizer = adam()
    schedule = build_scheduler(
        optimizer,
        "OneCycle",
        {
            "cycle_min_lr": 0.01,
            "cycle_max_lr": 0.1,
            "decay_lr_rate": 0.5,
            "cycle_first_step_size": s1,
            "cycle_second_step_size": s2,
            "cycle_first_stair_count": stairs[0],
            "cycle_second_stair_count": stairs[1],
            "decay_step_size": dss,
            "cycle_min_mom": 0.85,
            "cycle_max_mom": 0.95,
            "decay_mom_rate": 0.01,
        },
    )
    for t in range(-1, 40):
        if t < s1 + s2:
            scale = one_cycle(t, s1, s2, stairs)
            # DeepSpeed starts beta1 at cycle_min_mom; the formula (0.95 at t = -1) takes over after one step
            lr, beta1 = 0.01 + 0.09 * scale, 0.85 if t < 0 else 0.95 - 0.1 * scale
        else:
            d = t - (s1 + s2) + 1
            lr, beta1 = 0.01 / (1 + 0.5 * d / dss), 0.95 * (1 + 0.01 * d / dss)
        group = optimizer.param_groups[0]
        assert (group["lr"], group["betas"][0]) == (pytest.approx(lr, abs=1e-12), pytest.approx(beta1, abs=1e-12))
        assert group["betas"][1] == 0.99
        # get_mom() reports the formula's value, before the first step too (DeepSpeed's cycle_max_mom)
        reported = 0.95 if t < 0 else beta1
        assert schedule.get_mom() == [(pytest.approx(reported, abs=1e-12), 0.99)]
        schedule.step()
    peak = values_at(
        "OneCycle",
        {
            "cycle_min_lr": 0.0,
            "cycle_max_lr": 1.0,
            "cycle_first_step_size": s1,
            "cycle_second_step_size": s2,
            "cycle_first_stair_count": stairs[0],
        },
        [s1 - 1],
    )
    assert peak == [[pytest.approx(1.0)]]


@pytest.mark.parametrize("cycle_momentum", [True, False])
def test_one_cycle_first_engine_steps_run_with_deepspeeds_values(cycle_momentum: bool) -> None:
    """The lr and beta1 each optimizer step of the engine runs with: DeepSpeed's construction writes
    cycle_min_lr and cycle_min_mom, so step 0 runs with both; step k runs with the formula at t = k - 1."""
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.5, 0.999))
    engine = initialize(
        model,
        {
            "train_batch_size": 2,
            "scheduler": {
                "type": "OneCycle",
                "params": {
                    "cycle_min_lr": 0.01,
                    "cycle_max_lr": 0.1,
                    "cycle_first_step_size": 4,
                    "cycle_momentum": cycle_momentum,
                    "cycle_min_mom": 0.85,
                    "cycle_max_mom": 0.95,
                },
            },
        },
        single_process_grid(torch.device("cpu")),
        optimizer=optimizer,
    )
    seen: list[tuple[float, tuple[float, float]]] = []
    optimizer.register_step_pre_hook(
        lambda opt, *_: seen.append((opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]))
    )
    for _ in range(7):
        engine.backward(engine(torch.randn(2, 4)).sum())
        engine.step()
    scales = [0.0, 0.25, 0.5, 0.75, 1.0, 0.75, 0.5]  # step k: (k / 4) up to the peak at k = 4, then down
    lrs = [0.01 + 0.09 * scale for scale in scales]
    betas = [
        (0.85 if k == 0 else 0.95 - 0.1 * scale, 0.99) if cycle_momentum else (0.5, 0.999)
        for k, scale in enumerate(scales)
    ]
    assert [lr for lr, _ in seen] == pytest.approx(lrs, abs=1e-12)
    assert [beta for _, beta in seen] == [pytest.approx(beta, abs=1e-12) for beta in betas]


def test_one_cycle_without_decay_holds_the_floor_and_sgd_keeps_its_momentum() -> None:
    got = values_at("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 2}, [3, 4, 30])
    assert got == [[0.01], [0.01], [0.01]]
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0, momentum=0.9)
    with pytest.warns(UserWarning, match="no betas"):
        build_scheduler(sgd, "OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1})
    assert "betas" not in sgd.param_groups[0] and sgd.param_groups[0]["lr"] == 0.01


@pytest.mark.parametrize(
    "type_name,params",
    [
        ("LRRangeTest", {"lr_range_test_step_size": 3, "lr_range_test_staircase": True}),
        (
            "OneCycle",
            {
                "cycle_min_lr": 0.01,
                "cycle_max_lr": 0.1,
                "cycle_first_step_size": 3,
                "decay_lr_rate": 0.1,
                "decay_step_size": 2,
            },
        ),
        ("WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 5}),
        ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 5}),
        ("WarmupLR", {"warmup_num_steps": 12}),  # peaks at the group's lr, which the resumed optimizer has lost
    ],
)
def test_state_dict_round_trip_resumes_identically(type_name: str, params: dict[str, Any]) -> None:
    straight = values_at(type_name, params, list(range(-1, 25)))
    optimizer = adam()
    first = build_scheduler(optimizer, type_name, params)
    for _ in range(9):
        first.step()
    state = json.loads(json.dumps(first.state_dict()))  # the engine stores it as JSON
    resumed_optimizer = adam(lr=123.0)  # an lr restored from the checkpoint must not shift the schedule
    resumed = build_scheduler(resumed_optimizer, type_name, params)
    resumed.load_state_dict(state)
    tail = []
    for _ in range(9, 25):
        tail.append([g["lr"] for g in resumed_optimizer.param_groups])
        resumed.step()
    assert tail == straight[9:25]  # straight[i] is t = i - 1; we resumed at t = 8


def test_resume_under_a_changed_deepspeed_param_names_it_and_the_new_value_wins() -> None:
    params = {"total_num_steps": 20, "warmup_max_lr": 0.1, "warmup_num_steps": 5, "warmup_type": "linear"}
    optimizer = adam()
    first = build_scheduler(optimizer, "WarmupDecayLR", params)
    for _ in range(10):
        first.step()
    state = json.loads(json.dumps(first.state_dict()))
    resumed_optimizer = adam()
    resumed = build_scheduler(resumed_optimizer, "WarmupDecayLR", {**params, "total_num_steps": 40})
    resumed_optimizer.param_groups[0]["lr"] = optimizer.param_groups[0]["lr"]  # the engine restores the optimizer first
    line = restore_schedule(resumed, state, steps_taken=10)
    old, new = 0.1 * (20 - 9) / 15, 0.1 * (40 - 9) / 35
    assert resumed_optimizer.param_groups[0]["lr"] == pytest.approx(new)
    assert line == (
        f"resuming: the WarmupDecayLR schedule's total_num_steps changed from 20 to 40 (checkpoint -> config); "
        f'the LR jumps from {old:.2e} to {new:.2e}; set "total_num_steps": 20 in the scheduler block '
        "to keep the checkpoint's"
    )


def test_resume_under_changed_annealing_flags_names_each_and_the_flags_that_keep_them() -> None:
    def annealing(max_lr: float, warmup: int) -> AnnealingLR:  # counting 10 tokens per iteration
        return AnnealingLR(
            adam(), max_lr, min_lr=0.0, warmup_steps=warmup, decay_steps=100, decay_style="linear", increment=10
        )

    first = annealing(3e-3, 20)
    for _ in range(5):
        first.step()
    resumed = annealing(1e-3, 45)
    resumed.optimizer.param_groups[0]["lr"] = first.optimizer.param_groups[0]["lr"]
    line = restore_schedule(resumed, json.loads(json.dumps(first.state_dict())), steps_taken=5)
    old, new = 3e-3 * (1 - 30 / 80), 1e-3 * (1 - 5 / 55)  # 50 tokens in: past both warmups
    assert line == (
        "resuming: the LR schedule's peak LR changed from 0.003 to 0.001 and its warmup length from 20 "
        f"to 45 tokens (checkpoint -> flags); the LR jumps from {old:.2e} to {new:.2e}; "
        "pass --lr 0.003 --lr-warmup-tokens 20 to keep the checkpoint's"
    )


def test_resume_reads_schedule_states_saved_without_their_kind() -> None:
    def annealing() -> AnnealingLR:
        return AnnealingLR(
            adam(), max_lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=100, decay_style="linear", increment=2
        )

    same = annealing()
    assert restore_schedule(same, {"num_steps": 30}, steps_taken=15) is None and same.num_steps == 30
    other = annealing()
    line = restore_schedule(other, {"last_batch_iteration": 14, "base_lrs": [0.5]}, steps_taken=15)
    assert other.num_steps == 30 and line.startswith("resuming: the LR schedule changed kind from DeepSpeed's")


@pytest.mark.parametrize(
    "type_name,params,message",
    [
        ("WarmupCosine", {}, "did you mean 'WarmupCosineLR'"),
        ("Cyclic", {}, "use one of LRRangeTest, OneCycle"),
        ("WarmupLR", {"warmup_steps": 5}, "no parameter 'warmup_steps' .*warmup_num_steps.*allowed:"),
        ("WarmupDecayLR", {}, "needs total_num_steps"),
        ("LRRangeTest", {"lr_range_test_step_size": 0}, "lr_range_test_step_size must be a positive integer"),
        ("LRRangeTest", {"lr_range_test_step_rate": 0}, "lr_range_test_step_rate must be > 0"),
        ("LRRangeTest", {"lr_range_test_min_lr": 0.0}, "lr_range_test_min_lr must be > 0"),
        ("LRRangeTest", {"lr_range_test_min_lr": [0.1, 0.2]}, "2 values for 1 param groups"),
        ("LRRangeTest", {"lr_range_test_step_rate": "2"}, "lr_range_test_step_rate must be > 0, got '2'"),
        ("LRRangeTest", {"lr_range_test_staircase": "false"}, "lr_range_test_staircase must be true or false"),
        (
            "WarmupLR",
            {"warmup_type": "cosine"},
            r"unknown warmup_type 'cosine'; use one of log, linear \(DeepSpeed would",
        ),
        ("WarmupLR", {"warmup_num_steps": 0}, "warmup_num_steps must be a positive integer"),
        ("WarmupLR", {"warmup_min_lr": 0.9}, r"warmup_min_lr \[0.9\] exceeds warmup_max_lr \[0.5\] \(the groups' lr"),
        (
            "WarmupLR",
            {"warmup_min_lr": 0.3, "warmup_max_lr": 0.2},
            r"warmup_min_lr \[0.3\] exceeds warmup_max_lr \[0.2\];",
        ),
        ("WarmupLR", {"warmup_min_lr": -1.0}, "must be non-negative"),
        ("WarmupLR", {"warmup_min_lr": True}, "warmup_min_lr must be non-negative numbers, got True"),
        ("WarmupLR", {"warmup_max_lr": float("nan")}, "warmup_max_lr must be non-negative numbers, got nan"),
        ("WarmupLR", {"last_batch_iteration": -2}, "last_batch_iteration must be an integer >= -1"),
        ("WarmupDecayLR", {"total_num_steps": 20.0}, "total_num_steps must be a positive integer, got 20.0"),
        (
            "WarmupCosineLR",
            {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_min_ratio": "0.1"},
            "warmup_min_ratio must be between 0 and 1, got '0.1'",
        ),
        ("WarmupDecayLR", {"total_num_steps": 5, "warmup_num_steps": 10}, r"total_num_steps \(5\) is less than"),
        ("WarmupCosineLR", {"total_num_steps": 5, "warmup_num_steps": 10}, r"total_num_steps \(5\) is less than"),
        ("WarmupCosineLR", {"total_num_steps": 0}, "total_num_steps must be a positive integer"),
        ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 5, "cos_min_ratio": 2}, "cos_min_ratio must be"),
        ("WarmupCosineLR", {"total_num_steps": 2000, "warmup_type": "exp"}, "unknown warmup_type 'exp'"),
        (
            "OneCycle",
            {"cycle_min_lr": 0.2, "cycle_max_lr": 0.1},
            r"cycle_min_lr \[0.2\] exceeds cycle_max_lr \[0.1\]; give "
            "cycle_min_lr <= cycle_max_lr for every param group",
        ),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_first_step_size": 0}, "cycle_first_step_size"),
        (
            "OneCycle",
            {"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_second_step_size": -3},
            "cycle_second_step_size",
        ),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_first_stair_count": -1}, "stair_count"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "decay_lr_rate": 0.1}, "need decay_step_size > 0"),
        (
            "OneCycle",
            {"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "decay_mom_rate": -1},
            "decay_mom_rate must be a number >= 0",
        ),
        (
            "OneCycle",
            {"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "decay_lr_rate": None, "decay_step_size": 2},
            "decay_lr_rate must be a number >= 0, got None",
        ),
        (
            "OneCycle",
            {"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_min_mom": 0.95},
            "cycle_min_mom .* exceeds cycle_max_mom",
        ),
        (
            "OneCycle",
            {"cycle_min_lr": [0.01, 0.02], "cycle_max_lr": 0.1},
            "cycle_min_lr has 2 values for 1 param groups",
        ),
        (
            "OneCycle",
            {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_max_mom": [0.9, 0.95]},
            "cycle_max_mom has 2 values",
        ),
        ("OneCycle", {"cycle_min_lr": "0.01", "cycle_max_lr": 0.1}, "cycle_min_lr must be non-negative numbers"),
        (
            "OneCycle",
            {"cycle_min_lr": 0.01, "cycle_max_lr": None},
            "cycle_max_lr must be non-negative numbers, got None",
        ),
        (
            "OneCycle",
            {"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_second_step_size": 1.5},
            "cycle_second_step_size must be an integer >= 0, got 1.5",
        ),
        (
            "OneCycle",
            {"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_momentum": "false"},
            "cycle_momentum must be true or false",
        ),
    ],
)
def test_invalid_parameters_are_one_clear_config_error(type_name: str, params: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_scheduler(adam(), type_name, params)
    optimizer = adam()
    with pytest.raises(ValueError, match=message):  # what DeepSpeed raises, so code written for it catches ours
        build_scheduler(optimizer, type_name, params)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"]) == (0.5, (0.9, 0.999))  # untouched: every check comes before any write


def test_registry_names_match_deepspeed() -> None:
    assert list(SCHEDULES) == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
