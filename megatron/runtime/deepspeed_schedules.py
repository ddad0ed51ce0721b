"""DeepSpeed's learning-rate schedules (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR,
WarmupCosineLR) with DeepSpeed's parameter names, defaults and formulas, so that the
`"scheduler": {"type": ..., "params": ...}` block of an existing ds_config works unchanged.

Step semantics (shared by all): t = `last_batch_iteration`, -1 at construction. Construction
writes the value at t = -1 into the optimizer; the engine calls `step()` after every optimizer
step that was not skipped, so the k-th optimizer step (counting from 0) runs with the value at
t = k - 1. `state_dict()` is plain JSON (the engine writes it into the checkpoint's manifest).

A param group's lr may be a tensor (as torch and DeepSpeed allow): it is filled in place, and
the schedules that scale a group's own lr compute in its dtype, as DeepSpeed does.
"""

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from megatron.errors import ConfigError

WARMUP_TYPES = ("log", "linear")

Lr = float | torch.Tensor


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive_int(owner: str, name: str, value: Any) -> int:
    _check(_is_int(value) and value > 0, f"scheduler {owner}: {name} must be a positive integer, got {value!r}")
    return value


def _count(owner: str, name: str, value: Any) -> int:
    _check(_is_int(value) and value >= 0, f"scheduler {owner}: {name} must be an integer >= 0, got {value!r}")
    return value


def _non_negative(owner: str, name: str, value: Any) -> float:
    _check(_is_real(value) and value >= 0, f"scheduler {owner}: {name} must be a number >= 0, got {value!r}")
    return float(value)


def _flag(owner: str, name: str, value: Any) -> bool:
    # DeepSpeed tests truthiness, so "false" would switch the feature on.
    _check(isinstance(value, bool), f"scheduler {owner}: {name} must be true or false, got {value!r}")
    return value


def _per_group(owner: str, name: str, value: float | Sequence[float], groups: int) -> list[float]:
    """DeepSpeed accepts one value for all param groups or a list with one per group."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * groups
    _check(
        len(values) == groups,
        f"scheduler {owner}: {name} has {len(values)} values for {groups} param groups; "
        "give one value or one per group",
    )
    _check(
        all(_is_real(v) and v >= 0 for v in values),
        f"scheduler {owner}: {name} must be non-negative numbers, got {value!r}",
    )
    return [float(v) for v in values]


def _bounds(owner: str, low: str, high: str, lows: list[float], highs: list[float], note: str = "") -> None:
    """One bound per param group each; `note` says where the upper bounds came from."""
    _check(
        all(lo <= hi for lo, hi in zip(lows, highs)),
        f"scheduler {owner}: {low} {lows} exceeds {high} {highs}{note}; give {low} <= {high} for every param group",
    )


def _warmup_type(owner: str, warmup_type: Any) -> str:
    # DeepSpeed warns and falls back to "log": a typo ("linaer") would silently change the schedule.
    _check(
        warmup_type in WARMUP_TYPES,
        f"scheduler {owner}: unknown warmup_type {warmup_type!r}; use one of {', '.join(WARMUP_TYPES)} "
        "(DeepSpeed would fall back to log)",
    )
    return warmup_type


def _warmup_fraction(t: int, warmup: int, warmup_type: str) -> float:
    """0 -> 1 over the warmup (for 0 <= t < warmup); `warmup` is already max(2, steps)."""
    if warmup_type == "log":
        return (1.0 / math.log(warmup)) * math.log(t + 1)  # DeepSpeed's order, so values match to the bit
    return t / warmup


def _group_lr(lr: Lr) -> Lr:
    """A copy of a group's lr that keeps its type (a tensor lr stays a tensor of its dtype)."""
    return lr.detach().clone() if isinstance(lr, torch.Tensor) else float(lr)


def _like(lr: Lr, value: float) -> Lr:
    """A saved (JSON) lr back in the type of this run's group lr."""
    return torch.full_like(lr, value) if isinstance(lr, torch.Tensor) else float(value)


def _set_lr(group: dict[str, Any], lr: Lr) -> None:
    # A tensor lr is filled in place, as DeepSpeed and torch do: the optimizer (or a captured
    # graph) may hold that very tensor.
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr.squeeze() if isinstance(lr, torch.Tensor) else lr)
    else:
        group["lr"] = lr


class Schedule:
    """Shared step/apply/state protocol. Subclasses define `get_lr()` (and `get_mom()`) and end
    their `__init__` with `_apply()`, which writes the value at t = last_batch_iteration."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        _check(
            _is_int(last_batch_iteration) and last_batch_iteration >= -1,
            f"scheduler {self.kind}: last_batch_iteration must be an integer >= -1, got {last_batch_iteration!r}",
        )
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        # Saved in the state so a resume does not depend on whether the optimizer's lr was
        # restored (already scheduled) before or after this schedule was built.
        self.base_lrs = [_group_lr(group["lr"]) for group in optimizer.param_groups]
        self._last_lr: list[Lr] = []
        # the params it was built from (build_scheduler fills them in), saved so that a resume
        # under other params can say what changed
        self.settings: dict[str, Any] = {}

    @property
    def kind(self) -> str:
        return type(self).__name__

    def get_lr(self) -> list[Lr]:
        raise NotImplementedError

    def get_mom(self) -> list[tuple[float, float]] | None:
        return None

    def _applied_betas(self) -> list[tuple[float, float]] | None:
        """The betas written into the optimizer now: get_mom()'s unless a schedule says otherwise."""
        return self.get_mom()

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            _set_lr(group, lr)
        betas = self._applied_betas()
        if betas is not None:
            for group, beta in zip(self.optimizer.param_groups, betas):
                group["betas"] = beta
        # copies, not the groups' tensors, so a saved list does not change with the next step
        self._last_lr = [_group_lr(group["lr"]) for group in self.optimizer.param_groups]

    def step(self, batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if batch_iteration is None else batch_iteration
        self._apply()

    def get_last_lr(self) -> list[Lr]:
        return list(self._last_lr)

    def resume_at(self, steps_taken: int) -> None:
        """Continue a run that another kind of schedule drove for `steps_taken` optimizer steps."""
        self.step(steps_taken - 1)

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "settings": dict(self.settings),
            "last_batch_iteration": self.last_batch_iteration,
            "base_lrs": [float(lr) for lr in self.base_lrs],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])
        if "base_lrs" in state:
            self.base_lrs = [_like(lr, saved) for lr, saved in zip(self.base_lrs, state["base_lrs"])]
        self._apply()


class LRRangeTest(Schedule):
    """lr = min_lr * (1 + step_rate * I), I = (t+1)/step_size, floored when staircase."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        name = type(self).__name__
        self.min_lrs = _per_group(name, "lr_range_test_min_lr", lr_range_test_min_lr, len(optimizer.param_groups))
        _check(all(lr > 0 for lr in self.min_lrs), f"scheduler {name}: lr_range_test_min_lr must be > 0")
        self.step_size = _positive_int(name, "lr_range_test_step_size", lr_range_test_step_size)
        _check(
            _is_real(lr_range_test_step_rate) and lr_range_test_step_rate > 0,
            f"scheduler {name}: lr_range_test_step_rate must be > 0, got {lr_range_test_step_rate!r}",
        )
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = _flag(name, "lr_range_test_staircase", lr_range_test_staircase)
        self._apply()

    def get_lr(self) -> list[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1 + self.step_rate * interval) for lr in self.min_lrs]


class OneCycle(Schedule):
    """One triangular cycle of lr (min -> max -> min) with beta1 moving inversely, then decay.
    The lr and momentum bounds take one value or one per param group, as in DeepSpeed."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        name, groups = type(self).__name__, len(optimizer.param_groups)
        self.min_lrs = _per_group(name, "cycle_min_lr", cycle_min_lr, groups)
        self.max_lrs = _per_group(name, "cycle_max_lr", cycle_max_lr, groups)
        _bounds(name, "cycle_min_lr", "cycle_max_lr", self.min_lrs, self.max_lrs)
        self.first = _positive_int(name, "cycle_first_step_size", cycle_first_step_size)
        # None means as long as the first half; 0 (as in DeepSpeed) means the lr only rises and
        # drops back to cycle_min_lr at the cycle's last step.
        self.second = (
            self.first
            if cycle_second_step_size is None
            else _count(name, "cycle_second_step_size", cycle_second_step_size)
        )
        second_stairs = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.stairs = (
            _count(name, "cycle_first_stair_count", cycle_first_stair_count),
            _count(name, "cycle_second_stair_count", second_stairs),
        )
        self.decay_step_size = _count(name, "decay_step_size", decay_step_size)
        self.decay_lr_rate = _non_negative(name, "decay_lr_rate", decay_lr_rate)
        self.decay_mom_rate = _non_negative(name, "decay_mom_rate", decay_mom_rate)
        # decay_step_size 0 means "no decay" in DeepSpeed, which silently ignores any decay rate.
        _check(
            decay_step_size > 0 or (decay_lr_rate == 0 and decay_mom_rate == 0),
            f"scheduler {name}: decay_lr_rate/decay_mom_rate need decay_step_size > 0 (0 disables decay)",
        )
        self.min_moms = _per_group(name, "cycle_min_mom", cycle_min_mom, groups)
        self.max_moms = _per_group(name, "cycle_max_mom", cycle_max_mom, groups)
        _bounds(name, "cycle_min_mom", "cycle_max_mom", self.min_moms, self.max_moms)
        self.cycle_momentum = _flag(name, "cycle_momentum", cycle_momentum) and "betas" in optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            warnings.warn(f"OneCycle: {type(optimizer).__name__} has no betas, so momentum is not cycled", stacklevel=2)
        self._apply()

    @property
    def total_size(self) -> int:
        return self.first + self.second

    def _scale(self) -> float:
        """0 at the cycle's ends, 1 at its peak; stair counts hold it flat over equal stairs."""
        b, size = self.last_batch_iteration + 1, self.total_size
        x = 1 + b / size - math.floor(1 + b / size)
        ratio = self.first / size
        rising = x <= ratio  # always, when the second half is 0 steps long
        scale = x / ratio if rising else (x - 1) / (ratio - 1)
        stairs = self.stairs[0] if rising else self.stairs[1]
        if stairs > 0:
            # From the integer offset, not from `scale`: float error at a stair edge must not drop a stair.
            offset = b % size
            position = offset * stairs / self.first if rising else (size - offset) * stairs / self.second
            scale = math.floor(position) / stairs
        return scale

    def _decay_interval(self) -> float:
        decayed = self.last_batch_iteration - self.total_size + 1
        return decayed / self.decay_step_size if self.decay_step_size else 0.0

    def _in_cycle(self) -> bool:
        return self.last_batch_iteration < self.total_size

    def _applied_betas(self) -> list[tuple[float, float]] | None:
        # DeepSpeed starts beta1 at cycle_min_mom, not at the formula's cycle_max_mom, so the first
        # optimizer step runs with it; the formula takes over from the first step()
        if self.cycle_momentum and self.last_batch_iteration < 0:
            return [(beta1, 0.99) for beta1 in self.min_moms]
        return self.get_mom()

    def get_lr(self) -> list[Lr]:
        if self._in_cycle():
            scale = self._scale()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        factor = 1 + self.decay_lr_rate * self._decay_interval()
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """The cycle formula's betas, before the first step() too (cycle_max_mom then, as DeepSpeed
        reports it)."""
        if not self.cycle_momentum:
            return None
        if self._in_cycle():
            scale = self._scale()
            beta1s = [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        else:
            factor = 1 + self.decay_mom_rate * self._decay_interval()
            beta1s = [hi * factor for hi in self.max_moms]
        return [(beta1, 0.99) for beta1 in beta1s]


class WarmupLR(Schedule):
    """min -> max over the warmup (log or linear), then constant; max defaults to each group's lr."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        name, groups = type(self).__name__, len(optimizer.param_groups)
        self.min_lrs = _per_group(name, "warmup_min_lr", warmup_min_lr, groups)
        self.max_lrs = None if warmup_max_lr is None else _per_group(name, "warmup_max_lr", warmup_max_lr, groups)
        note = "" if warmup_max_lr is not None else " (the groups' lr, as warmup_max_lr is not given)"
        _bounds(name, "warmup_min_lr", "warmup_max_lr", self.min_lrs, [float(lr) for lr in self._peaks()], note)
        self.warmup_num_steps = max(2, _positive_int(name, "warmup_num_steps", warmup_num_steps))
        self.warmup_type = _warmup_type(name, warmup_type)
        self._apply()

    def _gamma(self) -> float:
        t = self.last_batch_iteration
        if t < self.warmup_num_steps:
            return _warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
        return self._after_warmup()

    def _after_warmup(self) -> float:
        return 1.0

    def _peaks(self) -> list[Lr]:
        # Without warmup_max_lr each group warms up to its own lr (a tensor lr in its dtype, as in DeepSpeed).
        return self.base_lrs if self.max_lrs is None else self.max_lrs

    def get_lr(self) -> list[Lr]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self._peaks())]


def _total_steps(owner: str, total_num_steps: Any, warmup_num_steps: int) -> int:
    _positive_int(owner, "total_num_steps", total_num_steps)
    _check(
        total_num_steps >= warmup_num_steps,
        f"scheduler {owner}: total_num_steps ({total_num_steps}) is less than warmup_num_steps "
        f"({warmup_num_steps}); raise total_num_steps or shorten the warmup",
    )
    return total_num_steps


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps. As in DeepSpeed, warmup_max_lr
    defaults to 0.001, not to the group's lr; an explicit null inherits each group's lr."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        name = type(self).__name__
        warmup = _positive_int(name, "warmup_num_steps", warmup_num_steps)
        self.total_num_steps = _total_steps(name, total_num_steps, warmup)  # set before WarmupLR applies t = -1
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def _after_warmup(self) -> float:
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - self.last_batch_iteration) / span)


class WarmupCosineLR(Schedule):
    """A ratio of each group's base lr: warmup_min_ratio -> 1, then cosine to cos_min_ratio."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 1e-4,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        name = type(self).__name__
        warmup = _positive_int(name, "warmup_num_steps", warmup_num_steps)
        self.total_num_steps = _total_steps(name, total_num_steps, warmup)
        for key, ratio in (("warmup_min_ratio", warmup_min_ratio), ("cos_min_ratio", cos_min_ratio)):
            _check(
                _is_real(ratio) and 0 <= ratio <= 1, f"scheduler {name}: {key} must be between 0 and 1, got {ratio!r}"
            )
        self.warmup_min_ratio, self.cos_min_ratio = float(warmup_min_ratio), float(cos_min_ratio)
        self.warmup_num_steps = max(2, warmup)
        self.warmup_type = _warmup_type(name, warmup_type)
        self._apply()

    def get_lr_ratio(self) -> float:
        t, warmup = self.last_batch_iteration, self.warmup_num_steps
        if t < 0:
            return 0.0
        if t < warmup:
            fraction = _warmup_fraction(t, warmup, self.warmup_type)
            return self.warmup_min_ratio + (1 - self.warmup_min_ratio) * fraction
        progress = min(1.0, (t - warmup + 1) / max(1, self.total_num_steps - warmup))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[Lr]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.base_lrs]
