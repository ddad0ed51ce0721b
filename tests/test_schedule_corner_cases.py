"""DeepSpeed 0.19's LR-schedule corner cases (issue 18): a tensor lr stays that tensor, OneCycle's
per-group bounds and zero-length second half, which schedules inherit each group's lr, and the
strict warmup_type. Expected values are DeepSpeed's formulas, written out again here."""

import json
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from megatron.errors import ConfigError
from megatron.runtime.lr_schedules import build_scheduler

BASES = (0.3, 0.07)  # the param groups' own lrs


def optimizer_with(lrs: tuple[float, ...] = BASES, dtype: torch.dtype | None = None) -> torch.optim.Adam:
    """Adam with one param group per lr; a tensor lr of `dtype` when one is given."""
    groups = [
        {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr if dtype is None else torch.tensor(lr, dtype=dtype)}
        for lr in lrs
    ]
    return torch.optim.Adam(groups)


def log_warmup(t: int, warmup: int) -> float:
    return (1.0 / math.log(warmup)) * math.log(t + 1)  # DeepSpeed's order of operations


def cosine_ratio(t: int) -> float:
    """WarmupCosineLR(total_num_steps=20, warmup_num_steps=5, warmup_min_ratio=0.1, cos_min_ratio=0.05)."""
    if t < 0:
        return 0.0
    if t < 5:
        return 0.1 + (1 - 0.1) * log_warmup(t, 5)
    progress = min(1.0, (t - 5 + 1) / (20 - 5))
    return max(0.0, 0.05 + (1 - 0.05) * (1 + math.cos(math.pi * progress)) / 2)


# --- a tensor lr -------------------------------------------------------------------------------


def triangle(t: int, half: int) -> float:
    """OneCycle's scale with equal halves: up over `half` steps, down over `half`."""
    b = (t + 1) % (2 * half)
    return b / half if b <= half else (2 * half - b) / half


# schedules whose values do not depend on the group's lr: DeepSpeed fills the float into the tensor
FLOAT_VALUED: dict[str, tuple[dict[str, Any], Callable[[int], float]]] = {
    "LRRangeTest": (
        {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 4, "lr_range_test_step_rate": 2.0},
        lambda t: 1e-3 * (1 + 2.0 * (t + 1) / 4),
    ),
    "OneCycle": (
        {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3},
        lambda t: 0.01 + 0.09 * triangle(t, 3) if t < 6 else 0.01,
    ),  # no decay after the cycle
    "WarmupLR": (
        {"warmup_min_lr": 0.01, "warmup_max_lr": 0.2, "warmup_num_steps": 8, "warmup_type": "linear"},
        lambda t: 0.01 if t < 0 else 0.01 + 0.19 * min(t, 8) / 8,
    ),
    "WarmupDecayLR": (
        {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_type": "linear"},
        lambda t: 0.0 if t < 0 else 0.001 * (t / 4 if t < 4 else max(0.0, (12 - t) / 8)),
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("type_name", list(FLOAT_VALUED))
def test_a_tensor_lr_is_filled_in_place_and_keeps_its_dtype(type_name: str, dtype: torch.dtype) -> None:
    params, expected = FLOAT_VALUED[type_name]
    optimizer = optimizer_with(dtype=dtype)
    tensors = [group["lr"] for group in optimizer.param_groups]
    schedule = build_scheduler(optimizer, type_name, params)
    for t in range(-1, 20):
        for group, tensor in zip(optimizer.param_groups, tensors):
            assert group["lr"] is tensor and tensor.dtype == dtype
            assert tensor.item() == pytest.approx(expected(t), rel=max(torch.finfo(dtype).eps, 1e-12), abs=1e-30)
        schedule.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "type_name,params,expected",
    [
        # without warmup_max_lr the peak is the group's own lr: min + (lr - min) * gamma, in the lr's dtype
        (
            "WarmupLR",
            {"warmup_min_lr": 0.001, "warmup_num_steps": 7},
            lambda t, lr: 0.001 if t < 0 else 0.001 + (lr - 0.001) * (log_warmup(t, 7) if t < 7 else 1.0),
        ),
        (
            "WarmupCosineLR",
            {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05},
            lambda t, lr: lr * cosine_ratio(t),
        ),
    ],
)
def test_a_groups_own_tensor_lr_is_scaled_in_its_dtype_as_deepspeed_does(
    type_name: str, params: dict[str, Any], expected: Callable[[int, Any], Any], dtype: torch.dtype
) -> None:
    """DeepSpeed keeps the group's lr tensor and does this arithmetic on it, so the values carry
    the dtype's rounding at each operation, not one rounding of a float64 result."""
    lrs = (0.3, 0.07, 3e-3, 0.77)
    optimizer = optimizer_with(lrs, dtype)
    originals = [torch.tensor(lr, dtype=dtype) for lr in lrs]
    schedule = build_scheduler(optimizer, type_name, params)
    for t in range(-1, 25):
        for group, original in zip(optimizer.param_groups, originals):
            want = torch.as_tensor(expected(t, original), dtype=dtype)
            assert group["lr"].dtype == dtype and group["lr"].item() == want.item(), (t, original)
        schedule.step()


def test_get_last_lr_gives_copies_of_tensor_lrs() -> None:
    """Tensors as DeepSpeed's are, but copies (as torch's schedulers give): a saved list must not
    change with the next step."""
    optimizer = optimizer_with(dtype=torch.float32)
    schedule = build_scheduler(optimizer, "WarmupLR", {"warmup_num_steps": 4, "warmup_type": "linear"})
    schedule.step()
    schedule.step()
    last = schedule.get_last_lr()
    assert all(isinstance(lr, torch.Tensor) and lr.dtype == torch.float32 for lr in last)
    assert [lr.item() for lr in last] == [torch.tensor(b * 1 / 4).item() for b in BASES]
    assert all(lr is not group["lr"] for lr, group in zip(last, optimizer.param_groups))
    schedule.step()
    assert [lr.item() for lr in last] == [torch.tensor(b * 1 / 4).item() for b in BASES]


@pytest.mark.parametrize(
    "type_name,params,dtype",
    [
        (
            "WarmupCosineLR",
            {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05},
            torch.float32,
        ),
        ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_num_steps": 14}, torch.bfloat16),
    ],
)
def test_a_tensor_lr_schedule_resumes_from_json_state_in_its_dtype(
    type_name: str, params: dict[str, Any], dtype: torch.dtype
) -> None:
    """Resumed equals uninterrupted to the bit: the saved lrs come back as tensors of the dtype."""
    straight_optimizer = optimizer_with(dtype=dtype)
    straight = build_scheduler(straight_optimizer, type_name, params)
    values = []
    for _ in range(-1, 16):
        values.append([group["lr"].item() for group in straight_optimizer.param_groups])
        straight.step()
    first = build_scheduler(optimizer_with(dtype=dtype), type_name, params)
    for _ in range(7):
        first.step()
    state = json.loads(json.dumps(first.state_dict()))  # the engine stores it as JSON
    resumed_optimizer = optimizer_with((5.0, 5.0), dtype)  # as if the checkpoint's lr had been restored
    tensors = [group["lr"] for group in resumed_optimizer.param_groups]
    resumed = build_scheduler(resumed_optimizer, type_name, params)
    resumed.load_state_dict(state)
    for t in range(7, 16):
        assert [group["lr"] for group in resumed_optimizer.param_groups] == tensors  # the same objects
        assert [lr.item() for lr in tensors] == values[t]  # values[t] is at t - 1; resumed at t = 6
        resumed.step()


@pytest.mark.parametrize(
    "type_name,params,expected",
    [
        (
            "WarmupLR",
            {"warmup_min_lr": 0.001, "warmup_num_steps": 10},
            lambda t, lr: 0.001 + (lr - 0.001) * log_warmup(t, 10),
        ),
        (
            "WarmupCosineLR",
            {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05},
            lambda t, lr: lr * cosine_ratio(t),
        ),
    ],
)
def test_log_warmup_equals_deepspeeds_to_the_bit(
    type_name: str, params: dict[str, Any], expected: Callable[[int, float], float]
) -> None:
    """DeepSpeed multiplies by 1 / log(warmup) rather than dividing by log(warmup): the last bit
    of some values differs between the two."""
    optimizer = optimizer_with()
    schedule = build_scheduler(optimizer, type_name, params)
    for t in range(0, 5):
        schedule.step()
        assert [group["lr"] for group in optimizer.param_groups] == [expected(t, lr) for lr in BASES], t


# --- OneCycle ----------------------------------------------------------------------------------


def test_one_cycle_takes_one_bound_per_param_group() -> None:
    optimizer = optimizer_with()
    build = {
        "cycle_min_lr": [0.01, 0.02],
        "cycle_max_lr": [0.1, 0.4],
        "cycle_min_mom": [0.8, 0.85],
        "cycle_max_mom": 0.95,
        "cycle_first_step_size": 2,
        "cycle_second_step_size": 2,
        "decay_step_size": 2,
        "decay_lr_rate": 0.5,
        "decay_mom_rate": 0.01,
    }
    schedule = build_scheduler(optimizer, "OneCycle", build)
    scales = [0.0, 0.5, 1.0, 0.5, 0.0]  # t = -1 .. 3: up over two steps, down over two
    for t in range(-1, 10):
        for group, lo, hi, mom_lo in zip(optimizer.param_groups, (0.01, 0.02), (0.1, 0.4), (0.8, 0.85)):
            if t < 4:
                lr, beta1 = lo + (hi - lo) * scales[t + 1], mom_lo if t < 0 else 0.95 - (0.95 - mom_lo) * scales[t + 1]
            else:
                decayed = (t - 4 + 1) / 2
                lr, beta1 = lo / (1 + 0.5 * decayed), 0.95 * (1 + 0.01 * decayed)
            assert group["lr"] == pytest.approx(lr, abs=1e-15) and group["betas"] == pytest.approx((beta1, 0.99))
        schedule.step()


@pytest.mark.parametrize(
    "stairs,scales",
    [
        (0, [0.0, 0.25, 0.5, 0.75, 0.0]),  # t = -1 .. 3: scale (t + 1) mod 4 / 4, back to the floor at t = 3
        (2, [0.0, 0.0, 0.5, 0.5, 0.0]),  # two stairs over the rising half
    ],
)
def test_one_cycle_with_no_second_half_rises_then_decays(stairs: int, scales: list[float]) -> None:
    """cycle_second_step_size 0, as DeepSpeed takes it: the cycle is the first half alone."""
    optimizer = optimizer_with((0.5,))
    schedule = build_scheduler(
        optimizer,
        "OneCycle",
        {
            "cycle_min_lr": 0.01,
            "cycle_max_lr": 0.09,
            "cycle_first_step_size": 4,
            "cycle_second_step_size": 0,
            "cycle_first_stair_count": stairs,
            "decay_step_size": 3,
            "decay_lr_rate": 1.0,
            "cycle_min_mom": 0.85,
            "cycle_max_mom": 0.95,
        },
    )
    for t in range(-1, 12):
        if t < 4:
            lr, beta1 = 0.01 + 0.08 * scales[t + 1], 0.85 if t < 0 else 0.95 - 0.1 * scales[t + 1]
        else:
            lr, beta1 = 0.01 / (1 + (t - 3) / 3), 0.95
        group = optimizer.param_groups[0]
        assert (group["lr"], group["betas"][0]) == (pytest.approx(lr, abs=1e-15), pytest.approx(beta1, abs=1e-15)), t
        schedule.step()


# --- which schedules inherit each group's lr -----------------------------------------------------


def test_warmup_decay_lr_peaks_at_deepspeeds_default_unless_null_inherits_each_groups_lr() -> None:
    params = {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_type": "linear"}

    def gamma(t: int) -> float:
        return 0.0 if t < 0 else t / 4 if t < 4 else max(0.0, (12 - t) / 8)

    for warmup_max_lr, peaks in (({}, (0.001, 0.001)), ({"warmup_max_lr": None}, BASES)):
        optimizer = optimizer_with()
        schedule = build_scheduler(optimizer, "WarmupDecayLR", {**params, **warmup_max_lr})
        for t in range(-1, 14):
            assert [group["lr"] for group in optimizer.param_groups] == pytest.approx(
                [peak * gamma(t) for peak in peaks], abs=1e-15
            ), (warmup_max_lr, t)
            schedule.step()


def test_warmup_lr_without_a_peak_warms_each_group_up_to_its_own_lr() -> None:
    optimizer = optimizer_with()
    schedule = build_scheduler(
        optimizer, "WarmupLR", {"warmup_min_lr": [0.01, 0.0], "warmup_num_steps": 5, "warmup_type": "linear"}
    )
    for t in range(-1, 8):
        want = [lo if t < 0 else lo + (base - lo) * min(t, 5) / 5 for lo, base in zip((0.01, 0.0), BASES)]
        assert [group["lr"] for group in optimizer.param_groups] == pytest.approx(want, abs=1e-15)
        schedule.step()


# --- warmup_type -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "type_name,params",
    [("WarmupLR", {}), ("WarmupDecayLR", {"total_num_steps": 2000}), ("WarmupCosineLR", {"total_num_steps": 2000})],
)
def test_an_unknown_warmup_type_stops_where_deepspeed_would_silently_warm_up_logarithmically(
    type_name: str, params: dict[str, Any]
) -> None:
    with pytest.raises(
        ConfigError,
        match=r"^scheduler \w+: unknown warmup_type 'linaer'; use one of log, linear "
        r"\(DeepSpeed would fall back to log\)$",
    ):
        build_scheduler(optimizer_with(), type_name, {**params, "warmup_type": "linaer"})


def test_a_tensor_lr_survives_a_checkpoint(tmp_path):
    """The group settings are saved as JSON numbers and come back as tensors of their dtype."""
    from megatron.parallel import single_process_grid
    from megatron.runtime import initialize

    grid = single_process_grid(torch.device("cpu"))
    model = torch.nn.Linear(3, 1)
    groups = [{"params": list(model.parameters()), "lr": torch.tensor(0.01, dtype=torch.float64)}]
    config = {"train_batch_size": 1, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}}
    engine = initialize(model, config, grid, model_parameters=groups)
    for _ in range(2):
        engine.backward(engine(torch.ones(1, 3)).sum())
        engine.step()
    engine.save_checkpoint(tmp_path, "step2")
    resumed_model = torch.nn.Linear(3, 1)
    resumed = initialize(
        resumed_model,
        config,
        grid,
        model_parameters=[{"params": list(resumed_model.parameters()), "lr": torch.tensor(0.01, dtype=torch.float64)}],
    )
    resumed.load_checkpoint(tmp_path, "step2")
    lr = resumed.optimizer.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.dtype == torch.float64
    assert float(lr) == float(engine.optimizer.param_groups[0]["lr"])
