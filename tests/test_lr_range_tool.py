"""tools/lr_range_test.py: the sweep's stopping rule and suggestion on made-up curves, the plot's
legend, axis titles and marks, the real tool on a tiny MoE GPT from pretrain_gpt.py's flags, the
--toy demo, and bad flags."""

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import matplotlib.image
import pytest

from megatron.cli.lr_range_test import curve_figure, main
from megatron.runtime.lr_range_test import RangePoint, Suggestion, Sweep, suggest, sweep
from tests.training_fixtures import tiny_flags, write_corpus

REPO = Path(__file__).resolve().parent.parent
MODEL = [
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
]


def replay(losses: list[float]) -> Any:
    """A step function giving these losses at lr 1e-4, 2e-4, ... (none when the loss is None: skipped)."""
    calls = iter(enumerate(losses, start=1))

    def step() -> tuple[float, float] | None:
        i, loss = next(calls)
        return None if loss is None else (1e-4 * i, loss)

    return step


def test_sweep_stops_when_the_smoothed_loss_passes_four_times_its_minimum() -> None:
    seen: list[tuple[int, RangePoint | None]] = []
    result = sweep(replay([8.0, None, 4.0, 1.0, 1.0] + [1000.0] * 20), 25, lambda i, p: seen.append((i, p)))
    assert result.diverged_lr is not None and "exceeded 4x its minimum" in result.stop_reason
    assert len(result.points) < 10 and seen[1] == (2, None)  # the skipped iteration is reported, not a point
    assert [p.iteration for p in result.points] == [i for i, p in seen if p is not None]


def test_sweep_stops_at_a_non_finite_loss_and_runs_to_the_end_otherwise() -> None:
    result = sweep(replay([5.0, 4.0, math.nan, 3.0]), 4, lambda i, p: None)
    assert len(result.points) == 2 and result.diverged_lr == pytest.approx(3e-4) and "not finite" in result.stop_reason
    result = sweep(replay([5.0, 4.0, 3.0]), 3, lambda i, p: None)
    assert len(result.points) == 3 and result.diverged_lr is None and result.stop_reason is None


def test_suggestion_runs_from_the_steepest_descent_to_the_lowest_loss() -> None:
    lrs = [1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0]
    smoothed = [9.0, 8.5, 5.0, 4.0, 3.9, 20.0]
    points = [RangePoint(i, lr, s, s) for i, (lr, s) in enumerate(zip(lrs, smoothed))]
    # the loss falls fastest over the decade from 1e-4 (8.5 -> 5.0), and is lowest at 1e-1
    assert 0.99e-4 < suggest(points).steepest_lr < 1e-3 and suggest(points).lowest_lr == 1e-1
    rising = [RangePoint(i, lr, float(i), float(i)) for i, lr in enumerate(lrs)]
    assert suggest(rising).steepest_lr is None and suggest(rising).lowest_lr == 1e-5


def assert_png(path: Path) -> None:
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    height, width, _ = matplotlib.image.imread(path).shape
    assert height > 0 and width > 0


def test_the_plot_names_the_curve_and_the_marks_and_titles_its_axes_with_units() -> None:
    points = [RangePoint(i, 10.0 ** (-5 + i / 10), 5 - math.sin(i / 10), 5.0) for i in range(40)]
    figure = curve_figure(Sweep(points, None, None), Suggestion(steepest_lr=1e-4, lowest_lr=1e-3), "lm loss")
    axes = figure.axes[0]
    assert [text.get_text() for text in figure.legends[0].get_texts()] == [
        "training lm loss, one point per iteration",
        "steepest descent, lr 1.0e-04",
        "lowest smoothed loss, lr 1.0e-03",
    ]
    assert axes.get_xlabel() == "learning rate (log scale)" and axes.get_xscale() == "log"
    assert axes.get_ylabel() == "training lm loss (cross-entropy, nats per token)"
    curve, steepest, lowest = axes.get_lines()
    assert list(curve.get_xdata()) == [p.lr for p in points] and list(curve.get_ydata()) == [p.loss for p in points]
    assert list(steepest.get_xdata()) == [1e-4, 1e-4] and list(lowest.get_xdata()) == [1e-3, 1e-3]
    # the y axis runs from the lowest loss to a tenth above the first tenth's highest
    lowest_loss = min(p.loss for p in points)
    assert axes.get_ylim() == pytest.approx((lowest_loss, 5.0 + 0.1 * (5.0 - lowest_loss)))
    # without a descent there is no range, and only the lowest loss is marked
    rising = curve_figure(Sweep(points, None, None), Suggestion(steepest_lr=None, lowest_lr=1e-5), "loss")
    assert [text.get_text() for text in rising.legends[0].get_texts()][1:] == ["lowest smoothed loss, lr 1.0e-05"]
    assert rising.axes[0].get_ylabel() == "training loss (mean squared error)"


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "lr_range_test.py"), *args], capture_output=True, text=True, timeout=120
    )


def test_range_test_on_a_tiny_moe_gpt_from_pretrain_flags(tmp_path: Path) -> None:
    out = tmp_path / "plots" / "range.png"
    # no --lr: the sweep sets the lr itself
    flags = tiny_flags(
        write_corpus(tmp_path),
        num_experts=4,
        expert_interval=1,
        save=tmp_path / "ckpt",
        tensorboard_dir=tmp_path / "tb",
        lr=None,
    )
    done = run_tool(
        *flags,
        "--lr_range_test_steps",
        "6",
        "--lr_range_test_min_lr",
        "1e-4",
        "--lr_range_test_step_rate",
        "20",
        "--lr_range_test_output",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(
        line.startswith(" iteration        6/       6 |") and "learning rate:" in line and "lm loss:" in line
        for line in lines
    )
    assert "learning-rate range" in lines[-2] or "never fell" in lines[-2]
    record = json.loads(out.with_suffix(".json").read_text())
    lrs, losses = [p["lr"] for p in record["points"]], [p["loss"] for p in record["points"]]
    assert len(lrs) == 6 and lrs[0] == pytest.approx(1e-4) and all(a < b for a, b in itertools.pairwise(lrs))
    assert all(math.isfinite(loss) for loss in losses) and record["lowest_loss_lr"] in lrs
    assert_png(out)
    # the range test writes nothing of the run itself
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "tb").exists()


def test_toy_demo_needs_no_model_or_data_flags(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "toy.png"
    result = main(
        [
            "--toy",
            "--lr_range_test_steps",
            "40",
            "--lr_range_test_min_lr",
            "1e-4",
            "--lr_range_test_step_rate",
            "20",
            "--lr_range_test_output",
            str(out),
        ]
    )
    assert len(result.points) == 40
    assert_png(out)
    assert "suggested learning-rate range" in capsys.readouterr().out


def toy_lines(tmp_path: Path, *flags: str) -> list[str]:
    done = run_tool("--toy", "--lr_range_test_output", str(tmp_path / "toy.png"), *flags)
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if line.startswith(" > ")]


def test_a_sweep_that_never_diverged_says_its_upper_end_is_only_where_it_stopped(tmp_path: Path) -> None:
    short = toy_lines(tmp_path, "--lr_range_test_steps", "3", "--lr_range_test_min_lr", "1e-4")
    assert short[1] == (
        " > warning: the sweep ended at lr 1.100E-03 before the loss diverged, so the range's upper end is where "
        "the sweep stopped, not where training breaks down; sweep further with a larger --lr_range_test_steps "
        "or --lr_range_test_step_rate"
    )
    steep = ["--lr_range_test_steps", "100", "--lr_range_test_min_lr", "1e-3", "--lr_range_test_step_rate", "1000"]
    diverged = toy_lines(tmp_path, *steep)
    assert diverged[1].startswith(" > stopped early: the smoothed loss") and not any("warning" in s for s in diverged)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--toy", "--lr_range_test_step_rate", "0"], "--lr-range-test-step-rate: '0' is not a positive number"),
        (["--toy", "--lr-range-test-min-lr", "-0.001"], "--lr-range-test-min-lr: '-0.001' is not a positive number"),
        (["--toy", "--lr_range_test_steps", "0"], "--lr-range-test-steps: '0' is not a positive integer"),
        (
            ["--toy", "--num-layers", "2"],
            "--toy runs the built-in demo and takes only the --lr_range_test_* flags; drop",
        ),
        ([*MODEL, "--num-expertz", "4"], "unknown flag --num-expertz; did you mean --num-experts?"),
        (MODEL, "no training data"),
        ([*MODEL, "--data-path", "corpus", "--dry-run"], "--dry-run sizes a model for pretrain_gpt.py; drop it"),
    ],
)
def test_bad_flags_are_one_sentence_and_exit_1(flags: list[str], message: str, capsys: Any) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(flags)
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.startswith("error: ") and message in err and err.count("\n") == 1
