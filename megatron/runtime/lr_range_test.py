"""LR range test: train a small MLP on synthetic regression while `LRRangeTest` raises the lr,
record (lr, loss), suggest a max lr and plot loss against lr (log x) into a PNG.

Suggestion rule: smooth the loss with a bias-corrected EMA (beta 0.9), take the lr where the
smoothed loss is lowest and suggest one tenth of it (the lowest point is already at the edge of
divergence, so a tenth leaves margin). The run stops early once the smoothed loss exceeds 4x its
best, as the rest of the curve says nothing more. The plot is drawn with numpy and written by a
small PNG writer (megatron/plotting.py) so the tool needs no plotting library.
"""

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

from megatron.errors import UserError
from megatron.plotting import draw_line as _line
from megatron.plotting import png_bytes
from megatron.runtime.deepspeed_schedules import LRRangeTest

EMA_BETA = 0.9
DIVERGED = 4.0


def run_range_test(min_lr: float, step_rate: float, step_size: int, steps: int, seed: int) -> list[tuple[float, float]]:
    """(lr, loss) for each optimizer step; the lr is the one that step ran with."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    inputs = torch.randn(4096, 16, generator=generator)
    projection = inputs @ torch.randn(16, 1, generator=generator)
    targets = projection + torch.sin(projection) + 0.1 * torch.randn(4096, 1, generator=generator)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=min_lr)
    schedule = LRRangeTest(optimizer, lr_range_test_min_lr=min_lr, lr_range_test_step_size=step_size,
                           lr_range_test_step_rate=step_rate)
    points: list[tuple[float, float]] = []
    smoothed, best = 0.0, math.inf
    for step in range(steps):
        batch = torch.randint(0, len(inputs), (256,), generator=generator)
        loss = torch.nn.functional.mse_loss(model(inputs[batch]), targets[batch])
        optimizer.zero_grad()
        loss.backward()
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        schedule.step()
        points.append((lr, loss.item()))
        smoothed = EMA_BETA * smoothed + (1 - EMA_BETA) * loss.item()
        debiased = smoothed / (1 - EMA_BETA ** (step + 1))
        best = min(best, debiased)
        if not math.isfinite(debiased) or debiased > DIVERGED * best:
            break
    return points


def smooth(losses: list[float]) -> list[float]:
    out, value = [], 0.0
    for i, loss in enumerate(losses):
        value = EMA_BETA * value + (1 - EMA_BETA) * loss
        out.append(value / (1 - EMA_BETA ** (i + 1)))
    return out


def suggest_lr(points: list[tuple[float, float]]) -> float:
    smoothed = smooth([loss for _, loss in points])
    lowest = min(range(len(points)), key=lambda i: smoothed[i] if math.isfinite(smoothed[i]) else math.inf)
    return points[lowest][0] / 10


def draw_plot(points: list[tuple[float, float]], marker_lr: float, width: int = 640, height: int = 400) -> np.ndarray:
    """White canvas, black axes with decade ticks on the log-lr axis, blue loss curve, red marker."""
    image = np.full((height, width, 3), 255, dtype=np.uint8)
    left, right, top, bottom = 50, width - 20, 20, height - 40
    log_lrs = np.log10([lr for lr, _ in points])
    losses = np.array([loss for _, loss in points])
    finite = np.isfinite(losses)
    lo_x, hi_x = float(log_lrs.min()), float(max(log_lrs.max(), log_lrs.min() + 1e-9))
    # Clip the y range so one diverged step does not flatten the interesting part of the curve.
    lo_y = float(losses[finite].min())
    hi_y = float(min(losses[finite].max(), lo_y + DIVERGED * (losses[finite][0] - lo_y + 1e-12)))

    def to_px(log_lr: float, loss: float) -> tuple[float, float]:
        x = left + (log_lr - lo_x) / (hi_x - lo_x) * (right - left)
        y = bottom - (min(loss, hi_y) - lo_y) / max(hi_y - lo_y, 1e-12) * (bottom - top)
        return x, y

    black = (0, 0, 0)
    _line(image, left, bottom, right, bottom, black)
    _line(image, left, top, left, bottom, black)
    for decade in range(math.ceil(lo_x), math.floor(hi_x) + 1):
        x, _ = to_px(decade, lo_y)
        _line(image, x, bottom, x, bottom + 8, black)
    for i in range(5):
        y = bottom - i * (bottom - top) / 4
        _line(image, left - 6, y, left, y, black)
    curve = [to_px(x, y) for x, y, ok in zip(log_lrs, losses, finite) if ok]
    for (x0, y0), (x1, y1) in itertools.pairwise(curve):
        _line(image, x0, y0, x1, y1, (30, 90, 200))
    marker_x, _ = to_px(math.log10(marker_lr), lo_y)
    if left <= marker_x <= right:
        _line(image, marker_x, top, marker_x, bottom, (210, 30, 30))
    return image


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-lr", type=float, default=1e-4, help="lr_range_test_min_lr")
    parser.add_argument("--step-rate", type=float, default=20.0, help="lr_range_test_step_rate")
    parser.add_argument("--step-size", type=int, default=1, help="lr_range_test_step_size")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps at most")
    parser.add_argument("--output", type=Path, default=Path("lr_range_test.png"), help="PNG plot; JSON goes beside it")
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    try:
        if args.steps <= 0:
            raise UserError(f"--steps must be positive, got {args.steps}")
        points = run_range_test(args.min_lr, args.step_rate, args.step_size, args.steps, args.seed)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    suggested = suggest_lr(points)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_bytes(png_bytes(draw_plot(points, suggested)))
    record = {"suggested_lr": suggested, "rule": "lr at the lowest EMA-smoothed loss / 10",
              "min_lr": args.min_lr, "step_rate": args.step_rate, "step_size": args.step_size, "seed": args.seed,
              "points": [{"lr": lr, "loss": loss} for lr, loss in points]}
    json_path = args.output.with_suffix(".json")
    json_path.write_text(json.dumps(record, indent=1))
    print(f"{len(points)} steps, lr {points[0][0]:.3g} -> {points[-1][0]:.3g}; "
          f"suggested max lr {suggested:.3g}; wrote {args.output} and {json_path}")
