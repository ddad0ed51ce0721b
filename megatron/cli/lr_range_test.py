"""`tools/lr_range_test.py`: an LR range test on the model pretrain_gpt.py would train. Give the
same Megatron flags (model, MoE, data, tokenizer, batch sizes, precision, ZeRO, --load, DeepSpeed
JSON) plus DeepSpeed's LRRangeTest parameters; the run raises the lr from
--lr_range_test_min_lr every iteration, prints a Megatron-style line per iteration and a
suggested lr range, and writes the curve as a PNG plot (loss against lr, log scale) and JSON.
`--toy` runs the same sweep on a small built-in regression network instead, as a quick demo.

The sweep, its stopping rule and the suggestion are in megatron/runtime/lr_range_test.py.
Nothing of the run is written but the curve: no checkpoints, no TensorBoard logs; --load reads
the weights only (fresh optimizer), and the flags' --lr and LR schedule are replaced. Without
--train-iters/-samples/-tokens the data is sized for the test's iterations.
"""

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron.config.flags import PretrainConfig, build_parser, parse_args, with_data_parallel_size
from megatron.config.parser import FlagParser, positive_float, positive_int
from megatron.config.spans import Span
from megatron.entry_point import run_entry_point
from megatron.errors import ConfigError, TrainingStopped
from megatron.parallel import build_parallel_grid
from megatron.plotting import Curve, Mark, line_figure, require_matplotlib, save_png
from megatron.runtime.config.schema import SchedulerConfig
from megatron.runtime.lr_range_test import (
    DIVERGENCE_FACTOR,
    RangePoint,
    Report,
    Step,
    Suggestion,
    Sweep,
    suggest,
    sweep,
)
from megatron.runtime.lr_schedules import build_scheduler
from megatron.training.loop import Trainer

if TYPE_CHECKING:
    from matplotlib.figure import Figure

SCHEDULE = "LRRangeTest"
PrintLine = Callable[[str], None]
# the y axis's unit for each loss the tool measures: the GPT's lm loss and the toy network's loss
LOSS_UNITS = {"lm loss": "cross-entropy, nats per token", "loss": "mean squared error"}


def build_range_test_parser() -> FlagParser:
    """The tool's own flags, in DeepSpeed's spelling (with Megatron's dashes accepted too)."""
    parser = FlagParser(add_help=False)
    g = parser.add_argument_group(
        "LR range test (DeepSpeed's LRRangeTest: lr = min_lr x (1 + step_rate x step / step_size))"
    )
    g.add_argument(
        "--lr_range_test_min_lr",
        "--lr-range-test-min-lr",
        dest="min_lr",
        type=positive_float,
        default=1e-5,
        help="the first iteration's lr",
    )
    g.add_argument(
        "--lr_range_test_step_size",
        "--lr-range-test-step-size",
        dest="step_size",
        type=positive_int,
        default=1,
        help="iterations per unit of step_rate",
    )
    g.add_argument(
        "--lr_range_test_step_rate",
        "--lr-range-test-step-rate",
        dest="step_rate",
        type=positive_float,
        default=5.0,
        help="lr increase per step_size iterations, in units of min_lr",
    )
    g.add_argument(
        "--lr_range_test_staircase",
        "--lr-range-test-staircase",
        dest="staircase",
        action="store_true",
        help="raise the lr once every step_size iterations instead of every iteration",
    )
    g.add_argument(
        "--lr_range_test_steps",
        "--lr-range-test-steps",
        dest="steps",
        type=positive_int,
        default=200,
        help="iterations at most (one global batch each); the test stops earlier once the loss diverges",
    )
    g.add_argument(
        "--lr_range_test_output",
        "--lr-range-test-output",
        dest="output",
        type=Path,
        default=Path("lr_range_test.png"),
        help="the plot; the curve goes to the same name with .json",
    )
    g.add_argument(
        "--toy",
        action="store_true",
        help="run on a small built-in regression network instead of a GPT (no model or data flags)",
    )
    return parser


def schedule_params(own: argparse.Namespace) -> dict[str, Any]:
    return {
        "lr_range_test_min_lr": own.min_lr,
        "lr_range_test_step_size": own.step_size,
        "lr_range_test_step_rate": own.step_rate,
        "lr_range_test_staircase": own.staircase,
    }


def last_lr(own: argparse.Namespace) -> float:
    """The lr of the test's last iteration, from a throwaway schedule."""
    schedule = build_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), SCHEDULE, schedule_params(own))
    schedule.step(own.steps - 2)  # iteration k runs with the value at t = k - 2 (t = -1 at construction)
    return schedule.get_last_lr()[0]


def with_sweep_defaults(argv: list[str], own: argparse.Namespace) -> list[str]:
    """pretrain_gpt.py requires a training length and an lr; the range test sets both itself (its
    schedule drives the lr from --lr_range_test_min_lr), so neither need be given. A DeepSpeed
    config may carry its own lr, which a --lr added here would contradict."""
    given = {arg.split("=", 1)[0] for arg in argv}
    extra = []
    if not given & {"--train-iters", "--train-samples", "--train-tokens"}:
        extra += ["--train-iters", str(own.steps)]
    if not given & {"--lr", "--deepspeed_config", "--deepspeed-config"}:
        extra += ["--lr", str(own.min_lr)]
    return argv + extra


def range_test_config(config: PretrainConfig, own: argparse.Namespace) -> PretrainConfig:
    """The run's config with LRRangeTest as its schedule for the test's iterations, writing
    nothing but the curve, and --load reading weights only (its optimizer would carry the old lr)."""
    if config.dry_run:
        raise ConfigError("--dry-run sizes a model for pretrain_gpt.py; drop it to run the LR range test")
    # a DeepSpeed "scheduler" block replaces the flags' LR schedule (and any the JSON names)
    scheduler = SchedulerConfig(type=SCHEDULE, params=schedule_params(own))
    return replace(
        config,
        training=replace(config.training, train_length=Span("iters", own.steps)),
        runtime=config.runtime.model_copy(update={"scheduler": scheduler}),
        logging=replace(config.logging, tensorboard_dir=None),
        checkpoint=replace(config.checkpoint, save=None, reset_iteration=config.checkpoint.load is not None),
    )


def gpt_step(trainer: Trainer) -> Step:
    """One global batch of the trainer's own step; the lm loss is averaged over data-parallel
    ranks, so that every rank sees the same curve and stops at the same iteration."""
    engine, t = trainer.engine, trainer.config.training
    data_iter = trainer.loader(trainer.train_data, 0)

    def step() -> tuple[float, float] | None:
        lr = engine.get_lr()[0]
        lm_loss = trainer.dp_mean(trainer.train_step(data_iter).lm)
        if engine.last_step_skipped:
            # fp16 overflow is routine while the loss scale settles; a long run of them, or any
            # non-finite step in bf16/fp32, means the lr is past divergence
            limit = t.max_consecutive_skipped_iterations
            settling = trainer.runtime.precision == "fp16" and (limit == 0 or engine.consecutive_skipped_steps < limit)
            return None if settling else (lr, float("nan"))
        return lr, lm_loss

    return step


def toy_step(own: argparse.Namespace, seed: int = 1234) -> Step:
    """An MLP on a noisy nonlinear regression: a curve in a second, with no data or model flags."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    inputs = torch.randn(4096, 16, generator=generator)
    projection = inputs @ torch.randn(16, 1, generator=generator)
    targets = projection + torch.sin(projection) + 0.1 * torch.randn(4096, 1, generator=generator)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters())
    schedule = build_scheduler(optimizer, SCHEDULE, schedule_params(own))

    def step() -> tuple[float, float]:
        batch = torch.randint(0, len(inputs), (256,), generator=generator)
        loss = torch.nn.functional.mse_loss(model(inputs[batch]), targets[batch])
        optimizer.zero_grad()
        loss.backward()
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        schedule.step()
        return lr, loss.item()

    return step


def printer(steps: int, loss_name: str, print_line: PrintLine) -> Report:
    """A Megatron-style line per iteration, with the time since the previous line."""
    last = time.perf_counter()

    def report(iteration: int, point: RangePoint | None) -> None:
        nonlocal last
        now = time.perf_counter()
        ms, last = 1000.0 * (now - last), now
        fields = [f" iteration {iteration:8d}/{steps:8d}", f"elapsed time per iteration (ms): {ms:.1f}"]
        if point is None:
            fields.append("skipped (fp16 overflow): the lr stays")
        else:
            fields += [
                f"learning rate: {point.lr:.3E}",
                f"{loss_name}: {point.loss:.6E}",
                f"smoothed {loss_name}: {point.smoothed_loss:.6E}",
            ]
        print_line(" | ".join(fields) + " |")

    return report


def summary(result: Sweep, suggestion: Suggestion) -> str:
    diverged = f"; the loss diverged at lr {result.diverged_lr:.3E}" if result.diverged_lr is not None else ""
    if suggestion.steepest_lr is None:
        return (
            f" > the smoothed loss never fell (lowest at lr {suggestion.lowest_lr:.3E}), so there is no range to "
            f"suggest; start lower with --lr_range_test_min_lr{diverged}"
        )
    return (
        f" > suggested learning-rate range: {suggestion.steepest_lr:.3E} (steepest loss descent) to "
        f"{suggestion.lowest_lr:.3E} (lowest smoothed loss){diverged}"
    )


def curve_figure(result: Sweep, suggestion: Suggestion, loss_name: str) -> "Figure":
    """The loss against the lr (log scale), with the suggested range's ends as labelled marks."""
    losses = [p.loss for p in result.points]
    # the y axis stops a little above the first tenth's losses, so a diverging tail does not flatten the rest
    lowest, head = min(losses), max(losses[: max(len(losses) // 10, 1)])
    top = head + 0.1 * (head - lowest) if head > lowest else max(losses)
    marks = [Mark(suggestion.lowest_lr, f"lowest smoothed loss, lr {suggestion.lowest_lr:.1e}")]
    if suggestion.steepest_lr is not None:
        marks.insert(0, Mark(suggestion.steepest_lr, f"steepest descent, lr {suggestion.steepest_lr:.1e}"))
    return line_figure(
        [Curve(f"training {loss_name}, one point per iteration", [(p.lr, p.loss) for p in result.points])],
        title=f"LR range test: training {loss_name} against learning rate",
        x_title="learning rate (log scale)",
        y_title=f"training {loss_name} ({LOSS_UNITS[loss_name]})",
        log_x=True,
        y_range=(lowest, top),
        marks=marks,
    )


def write_outputs(
    own: argparse.Namespace, argv: list[str], result: Sweep, suggestion: Suggestion, loss_name: str
) -> Path:
    own.output.parent.mkdir(parents=True, exist_ok=True)
    save_png(curve_figure(result, suggestion, loss_name), own.output)
    record = {
        "argv": argv,
        "scheduler": {"type": SCHEDULE, "params": schedule_params(own)},
        "steps": own.steps,
        "rule": f"EMA-smoothed loss; range from its steepest descent per decade of lr to its minimum; stop when "
        f"it exceeds {DIVERGENCE_FACTOR:g}x its minimum or a loss or gradient is not finite",
        "steepest_descent_lr": suggestion.steepest_lr,
        "lowest_loss_lr": suggestion.lowest_lr,
        "diverged_lr": result.diverged_lr,
        "stop_reason": result.stop_reason,
        "loss": loss_name,
        "points": [asdict(point) for point in result.points],
    }
    json_path = own.output.with_suffix(".json")
    json_path.write_text(json.dumps(record, indent=1))
    return json_path


def finish(
    own: argparse.Namespace, argv: list[str], result: Sweep, loss_name: str, writes: bool, print_line: PrintLine
) -> Sweep:
    if not result.points:
        raise TrainingStopped(
            f"all {own.steps} iterations skipped their step (fp16 overflow), so there is no curve; "
            "raise --lr_range_test_steps or train in bf16"
        )
    if result.stop_reason:
        print_line(f" > stopped early: {result.stop_reason}")
    elif result.diverged_lr is None:
        print_line(
            f" > warning: the sweep ended at lr {result.points[-1].lr:.3E} before the loss diverged, so the range's "
            "upper end is where the sweep stopped, not where training breaks down; sweep further with a larger "
            "--lr_range_test_steps or --lr_range_test_step_rate"
        )
    suggestion = suggest(result.points)
    print_line(summary(result, suggestion))
    if writes:
        json_path = write_outputs(own, argv, result, suggestion, loss_name)
        print_line(f" > wrote {own.output} and {json_path}")
    return result


def print_line(line: str) -> None:
    print(line, flush=True)


def run(argv: list[str]) -> Sweep:
    own, rest = build_range_test_parser().parse_known_args(argv)
    if "-h" in rest or "--help" in rest:  # both flag sets, in one help text
        FlagParser(
            description=__doc__.split("\n\n")[0], parents=[build_parser(), build_range_test_parser()], add_help=False
        ).parse_args(["--help"])
    require_matplotlib()  # before the sweep, which on a real model takes a while
    plan = (
        f" > LR range test: lr {own.min_lr:.3E} -> {last_lr(own):.3E} over at most {own.steps} iterations; "
        f"stops once the smoothed loss exceeds {DIVERGENCE_FACTOR:g}x its minimum"
    )
    if own.toy:
        if rest:
            raise ConfigError(
                f"--toy runs the built-in demo and takes only the --lr_range_test_* flags; drop {rest[0]} or --toy"
            )
        print_line(plan)
        result = sweep(toy_step(own), own.steps, printer(own.steps, "loss", print_line))
        return finish(own, argv, result, "loss", True, print_line)
    config = parse_args(with_sweep_defaults(rest, own))
    grid = build_parallel_grid(ep_size=config.training.expert_parallel_size)
    trainer = Trainer(range_test_config(with_data_parallel_size(config, grid.dp_size), own), grid)
    trainer.log.info(plan)
    result = sweep(gpt_step(trainer), own.steps, printer(own.steps, "lm loss", trainer.log.info))
    return finish(own, argv, result, "lm loss", grid.is_first_rank, trainer.log.info)


def main(argv: list[str] | None = None) -> Sweep:
    return run_entry_point(lambda: run(sys.argv[1:] if argv is None else argv))
