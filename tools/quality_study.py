"""The quality study of docs/quality.md: the tiny CPU recipes on the demo corpus with equal training
tokens (dense, MoE, PR-MoE, and the MoS student without KD, with KD throughout and with staged KD
from the PR-MoE run as teacher). Writes validation-loss curves as a PNG, the numbers as JSON, and
prints a Markdown table. Run `make demo` first (it builds the corpus); every run starts afresh.

    python tools/quality_study.py --output docs/quality   # -> docs/quality.png, docs/quality.json
    # runs (checkpoints, logs) go to --work-dir, default demo_output/quality_study
    # redraw docs/quality.png from docs/quality.json alone: write_plot(json.loads(text), Path("docs/quality"))
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if importlib.util.find_spec("megatron") is None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron.config.parser import FlagParser, positive_int
from megatron.errors import UserError
from megatron.plotting import Curve, line_figure, require_matplotlib, save_png

if TYPE_CHECKING:
    from matplotlib.figure import Figure

RECIPES = Path(__file__).resolve().parent.parent / "examples_deepspeed" / "MoE"
# (label, recipe, environment); the MoS runs use the PR-MoE run's checkpoint as their teacher
VARIANTS = [
    ("dense", "ds_pretrain_gpt_tiny_dense_cpu.sh", {}),
    ("MoE (8 experts, top-1)", "ds_pretrain_gpt_tiny_MoE_cpu.sh", {}),
    ("PR-MoE (4/8 residual) = teacher", "ds_pretrain_gpt_tiny_PR-MoE_cpu.sh", {}),
    ("MoS student, no KD", "ds_pretrain_gpt_tiny_MoS_cpu.sh", {"MOS_KD": "0"}),
    ("MoS student, KD throughout", "ds_pretrain_gpt_tiny_MoS_cpu.sh", {"KD_STOP_TOKENS": "never"}),
    ("MoS student, staged KD (off after 60%)", "ds_pretrain_gpt_tiny_MoS_cpu.sh", {}),
]
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")
SPEED = re.compile(r"tokens per second: ([0-9.]+)")
SIZE = re.compile(r"^(total parameters|active parameters per token): ([\d,]+)", re.M)


def run(recipe: str, env: dict[str, str], dry: bool = False) -> str:
    full = {**os.environ, **env, **({"DRY_RUN": "1"} if dry else {})}
    done = subprocess.run(["bash", str(RECIPES / recipe)], env=full, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"error: {recipe} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


def study(work: Path, train_tokens: int) -> list[dict]:
    shutil.rmtree(work, ignore_errors=True)  # the recipes resume from --load: start every run afresh
    teacher = work / "variant3" / "checkpoint" / "tiny-PR-MoE"
    results = []
    for number, (label, recipe, extra) in enumerate(VARIANTS, start=1):
        env = {
            "OUTPUT_DIR": str(work / f"variant{number}"),
            "TEACHER_DIR": str(teacher),
            "TINY_TRAIN_TOKENS": str(train_tokens),
            "TINY_EVAL_INTERVAL": "20",
            **extra,
        }
        sizes = dict(SIZE.findall(run(recipe, env, dry=True)))
        print(f"[{number}/{len(VARIANTS)}] {label}: training ...", flush=True)
        log = run(recipe, env)
        curve = [(int(it), float(loss)) for it, loss in VALIDATION.findall(log)]
        speeds = [float(s) for s in SPEED.findall(log)]
        results.append(
            {
                "number": number,
                "label": label,
                "recipe": recipe,
                "environment": extra,
                "total_parameters": int(sizes["total parameters"].replace(",", "")),
                "active_parameters": int(sizes["active parameters per token"].replace(",", "")),
                "validation": curve,
                "final_validation_loss": curve[-1][1],
                "tokens_per_second": sum(speeds[1:]) / max(len(speeds) - 1, 1),  # the first interval includes warm-up
            }
        )
        print(
            f"    validation loss {curve[0][1]:.3f} -> {curve[-1][1]:.3f}, {results[-1]['tokens_per_second']:.0f} tokens/s",
            flush=True,
        )
    return results


def table(results: list[dict], train_tokens: int) -> str:
    lines = [
        f"Equal training tokens: {train_tokens:,} per run.",
        "",
        "| # | variant | total params | active params / token | final validation loss | tokens/s |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r['number']} | {r['label']} | {r['total_parameters']:,} | {r['active_parameters']:,} | "
        f"{r['final_validation_loss']:.3f} | {r['tokens_per_second']:.0f} |"
        for r in results
    ]
    return "\n".join(lines)


def figure(record: dict) -> "Figure":
    """Validation-loss curves, named by the table's numbers and labels, from the JSON record main() saves."""
    # from the first evaluation after the start: the untrained loss would squash the differences
    curves = [
        Curve(f"{r['number']} {r['label']}", [(it, loss) for it, loss in r["validation"] if it > 0])
        for r in record["runs"]
    ]
    return line_figure(
        curves,
        title=f"Validation loss, {record['train_tokens']:,} training tokens per run",
        x_title="iteration (8 x 128 tokens each)",
        y_title="validation loss (cross-entropy, nats per token)",
    )


def write_plot(record: dict, output: Path) -> None:
    """OUTPUT.png from a record as main() saves it to OUTPUT.json, so a plot can be redrawn without the runs."""
    save_png(figure(record), output.with_suffix(".png"))


def build_parser() -> FlagParser:
    parser = FlagParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("docs/quality"), help="writes OUTPUT.png and OUTPUT.json")
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path("demo_output/quality_study"),
        help="checkpoints and logs of the runs (emptied first)",
    )
    parser.add_argument("--train-tokens", type=positive_int, default=307200, help="per run (300 iterations of 8 x 128)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:  # before the runs, which take a while
        require_matplotlib()
    except UserError as error:
        sys.exit(f"error: {error}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    results = study(args.work_dir, args.train_tokens)
    record = {"train_tokens": args.train_tokens, "runs": results}
    args.output.with_suffix(".json").write_text(json.dumps(record, indent=1))
    write_plot(record, args.output)
    print(table(results, args.train_tokens))


if __name__ == "__main__":
    main()
