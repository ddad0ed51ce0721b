"""The LR range test's sweep, for any model: run steps while an `LRRangeTest` schedule raises the
learning rate, smooth the loss, stop once it diverges, and read a learning-rate range off the curve.

The loss is smoothed with a bias-corrected EMA (beta 0.9), since single batches are too noisy to
compare. The sweep stops once the smoothed loss exceeds 4x its lowest value, or a loss or its
gradients are not finite: past that point the curve says nothing more. The suggested range runs
from the lr where the smoothed loss falls fastest per decade of lr (training clearly makes
progress there) to the lr where it is lowest (beyond it, training gets worse).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

EMA_BETA = 0.9
DIVERGENCE_FACTOR = 4.0
SLOPE_SPAN = 0.1  # decades of lr over which the suggestion measures the loss's slope


@dataclass(frozen=True)
class RangePoint:
    iteration: int
    lr: float  # the lr this iteration's optimizer step ran with
    loss: float
    smoothed_loss: float


@dataclass(frozen=True)
class Sweep:
    points: list[RangePoint]
    diverged_lr: float | None  # the lr at which the sweep stopped early, if it did
    stop_reason: str | None


@dataclass(frozen=True)
class Suggestion:
    steepest_lr: float | None  # None when the smoothed loss never fell
    lowest_lr: float


# one iteration: (the lr it ran with, its loss), or None when it skipped its step (fp16 overflow)
Step = Callable[[], tuple[float, float] | None]
# told of every iteration, with its point or None when it was skipped
Report = Callable[[int, RangePoint | None], None]


def sweep(step: Step, steps: int, report: Report) -> Sweep:
    points: list[RangePoint] = []
    average, lowest = 0.0, math.inf
    for iteration in range(1, steps + 1):
        result = step()
        if result is None:
            report(iteration, None)
            continue
        lr, loss = result
        if not math.isfinite(loss):
            return Sweep(points, lr, f"the loss or its gradients were not finite at iteration {iteration}, lr {lr:.3E}")
        average = EMA_BETA * average + (1 - EMA_BETA) * loss
        smoothed = average / (1 - EMA_BETA ** (len(points) + 1))
        points.append(RangePoint(iteration, lr, loss, smoothed))
        report(iteration, points[-1])
        lowest = min(lowest, smoothed)
        if smoothed > DIVERGENCE_FACTOR * lowest:
            return Sweep(
                points,
                lr,
                f"the smoothed loss {smoothed:.4g} exceeded {DIVERGENCE_FACTOR:g}x its minimum "
                f"{lowest:.4g} at iteration {iteration}, lr {lr:.3E}",
            )
    return Sweep(points, None, None)


def suggest(points: list[RangePoint]) -> Suggestion:
    """The steepest descent is looked for only up to the lowest point (a fall after a spike past
    it is recovery, not progress), over steps of SLOPE_SPAN decades: the linear schedule packs
    points densely at high lr, where the slope between neighbours would measure noise."""
    lowest = min(range(len(points)), key=lambda i: points[i].smoothed_loss)
    # the last point per lr: a staircase holds each lr for several iterations
    by_lr = {math.log10(p.lr): p.smoothed_loss for p in points[: lowest + 1]}
    log_lrs, losses = np.array(list(by_lr)), np.array(list(by_lr.values()))
    if len(log_lrs) < 2:
        return Suggestion(None, points[lowest].lr)
    grid = np.arange(log_lrs[0], log_lrs[-1], SLOPE_SPAN)  # whole steps only: a sliver at the end is noise
    if len(grid) < 2:
        grid = log_lrs[[0, -1]]
    slopes = np.diff(np.interp(grid, log_lrs, losses)) / np.diff(grid)
    steepest = int(np.argmin(slopes))
    return Suggestion(10 ** float(grid[steepest]) if slopes[steepest] < 0 else None, points[lowest].lr)
