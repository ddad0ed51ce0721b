"""Resuming an LR schedule from a checkpoint written under another kind of schedule (Megatron's
annealing <-> a DeepSpeed "scheduler" block) or other settings: this run's settings win, and one
line says what changed and how to keep the checkpoint's."""

import json
import math
from dataclasses import dataclass
from typing import Any

from megatron.runtime.deepspeed_schedules import Schedule
from megatron.runtime.lr_schedules import AnnealingLR


@dataclass(frozen=True)
class SettingChange:
    name: str  # as the resume line calls it
    old: str
    new: str
    keep: str  # what to give to keep the checkpoint's value


# AnnealingLR setting -> (what the resume line calls it, the flag that sets it)
ANNEALING_NAMES = {
    "warmup_steps": ("warmup length", "--lr-warmup"),
    "decay_steps": ("decay length", "--lr-decay"),
    "decay_style": ("decay style", "--lr-decay-style"),
    "max_lr": ("peak LR", "--lr"),
    "min_lr": ("minimum LR", "--min-lr"),
}


def _same(old: Any, new: Any) -> bool:
    if isinstance(old, float) or isinstance(new, float):
        numbers = isinstance(old, (int, float)) and isinstance(new, (int, float))
        return numbers and math.isclose(old, new, rel_tol=1e-9)
    return old == new


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else json.dumps(value)


def _annealing_change(key: str, old: Any, new: Any, increment: int) -> SettingChange:
    name, flag = ANNEALING_NAMES[key]
    if not key.endswith("_steps"):
        old_text, new_text = (f"{old:g}", f"{new:g}") if isinstance(old, float) else (str(old), str(new))
        return SettingChange(name, old_text, new_text, f"{flag} {old_text}")
    # the schedule counts tokens; the flags people type usually count iterations
    in_iterations = old % increment == new % increment == 0
    per, unit, suffix = (increment, "iterations", "iters") if in_iterations else (1, "tokens", "tokens")
    return SettingChange(name, f"{old // per:,}", f"{new // per:,} {unit}", f"{flag}-{suffix} {old // per}")


def _changes(schedule: "AnnealingLR | Schedule", saved: dict[str, Any]) -> list[SettingChange]:
    current = schedule.settings
    differ = [key for key in current if key in saved and not _same(saved[key], current[key])]
    if isinstance(schedule, AnnealingLR):
        return [_annealing_change(key, saved[key], current[key], schedule.increment) for key in differ]
    return [
        SettingChange(key, _show(saved[key]), _show(current[key]), f"{json.dumps(key)}: {json.dumps(saved[key])}")
        for key in differ
    ]


def _describe(kind: str) -> str:
    if kind == AnnealingLR.kind:
        return "Megatron's LR annealing (flags)"
    return f"DeepSpeed's {kind} (config scheduler block)"


def _saved_kind(schedule: "AnnealingLR | Schedule", state: dict[str, Any]) -> str:
    """Checkpoints written before the kind was saved tell it by their step counter only."""
    if "kind" in state:
        return state["kind"]
    if "num_steps" in state:
        return AnnealingLR.kind
    return schedule.kind if isinstance(schedule, Schedule) else "LR schedule"


def _lr(schedule: "AnnealingLR | Schedule") -> float:
    return float(schedule.optimizer.param_groups[0]["lr"])


def _jump(before: float, after: float) -> str:
    if math.isclose(before, after, rel_tol=1e-9):
        return f"the LR stays at {after:.2e}"
    return f"the LR jumps from {before:.2e} to {after:.2e}"


def restore_schedule(schedule: Any, state: dict[str, Any], steps_taken: int) -> str | None:
    """Load a checkpoint's schedule state after the optimizer's (whose lr is the checkpoint's);
    this run's settings win, as with Megatron's --override-opt_param-scheduler. Returns the one
    line to print where the run's schedule differs from the checkpoint's: another kind (it then
    continues after the checkpoint's `steps_taken` optimizer steps) or other settings."""
    if not isinstance(schedule, (AnnealingLR, Schedule)):
        schedule.load_state_dict(state)  # a caller's own scheduler object keeps its own format
        return None
    before, kind = _lr(schedule), _saved_kind(schedule, state)
    if kind != schedule.kind:
        schedule.resume_at(steps_taken)
        return (
            f"resuming: the LR schedule changed kind from {_describe(kind)} in the checkpoint to "
            f"{_describe(schedule.kind)}, which continues after the checkpoint's {steps_taken:,} optimizer "
            f"steps; {_jump(before, _lr(schedule))}"
        )
    schedule.load_state_dict(state)
    changes = _changes(schedule, state.get("settings", {}))
    if not changes:
        return None
    first, *rest = changes
    what = f"{first.name} changed from {first.old} to {first.new}" + "".join(
        f" and its {change.name} from {change.old} to {change.new}" for change in rest
    )
    if isinstance(schedule, AnnealingLR):
        owner, source, keep = "the LR schedule", "flags", "pass " + " ".join(change.keep for change in changes)
    else:
        owner, source = f"the {schedule.kind} schedule", "config"
        keep = f"set {', '.join(change.keep for change in changes)} in the scheduler block"
    return (
        f"resuming: {owner}'s {what} (checkpoint -> {source}); {_jump(before, _lr(schedule))}; "
        f"{keep} to keep the checkpoint's"
    )
