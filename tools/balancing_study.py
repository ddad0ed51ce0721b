"""The load-balancing study of docs/quality.md: the demo's 4-layer MoE on the demo corpus, trained
with the same tokens and sigmoid top-2 routing, balanced by the auxiliary loss alone or by
aux-loss-free expert biases (DeepSeek-V3's) at three update rates, with DeepSpeed's softmax top-2 and its auxiliary loss
as the classic reference. Writes the expert-load imbalance (max / mean tokens per expert, mean over
the MoE layers) and validation-loss curves as PNGs, the numbers as JSON, and prints a Markdown
table. Run `make demo` first (it builds the corpus and tokenizer).

    python tools/balancing_study.py --output docs/balancing   # -> docs/balancing_{imbalance,loss}.png, .json
    # redraw the PNGs from docs/balancing.json alone: write_plots(json.loads(text), Path("docs/balancing"))
"""

import importlib.util
import json
import os
import re
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

REPO = Path(__file__).resolve().parent.parent
# the demo's model and schedule (examples_deepspeed/pretrain_gpt_demo.sh), top-2, dropless
MODEL = (
    "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --num-experts 8 --expert-interval 1 "
    "--topk 2 --disable-moe-token-dropping --micro-batch-size 8 --global-batch-size 16 --lr 1e-3 --min-lr 1e-4 "
    "--lr-decay-style cosine --lr-warmup-iters 10 --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 "
    "--hidden-dropout 0.0 --attention-dropout 0.0 --split 949,50,1 --num-workers 0 --log-interval 5 "
    "--eval-iters 4 --eval-at-start --seed 1234"
)
VARIANTS = [  # (label, flags)
    ("softmax top-2, aux loss 0.01 (DeepSpeed)", "--moe-loss-coeff 0.01"),
    ("sigmoid top-2, aux loss 0.01", "--moe-router-score-function sigmoid --moe-loss-coeff 0.01"),
    # DeepSeek-V3's rate moves a bias by at most 0.2 in 200 steps; a short run needs a faster one
    *(
        (
            f"sigmoid top-2, expert bias {rate}, no aux loss",
            f"--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate {rate} "
            "--moe-router-load-balancing-type none",
        )
        for rate in ("1e-3", "3e-3", "1e-2")
    ),
]
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")
ITERATION = re.compile(r"^ iteration +(\d+)/", re.M)
IMBALANCE = re.compile(r"layer \d+: imbalance ([0-9.]+)")


def train(demo: Path, flags: str, iterations: int, eval_interval: int) -> str:
    command = [
        sys.executable,
        str(REPO / "pretrain_gpt.py"),
        *MODEL.split(),
        *flags.split(),
        "--train-iters",
        str(iterations),
        "--eval-interval",
        str(eval_interval),
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        str(demo / "tokenizer.model"),
        "--data-path",
        str(demo / "corpus_text_document"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        sys.exit(f"error: training failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


def imbalance_curve(log: str) -> list[tuple[int, float]]:
    """(iteration, mean over MoE layers of max/mean tokens per expert) for each log interval."""
    curve = []
    for line in log.splitlines():
        iteration = ITERATION.match(line)
        if iteration:
            current = int(iteration.group(1))
        elif line.startswith(" moe |"):
            values = [float(v) for v in IMBALANCE.findall(line)]
            curve.append((current, sum(values) / len(values)))
    return curve


def study(demo: Path, iterations: int, eval_interval: int) -> list[dict]:
    results = []
    for number, (label, flags) in enumerate(VARIANTS, start=1):
        print(f"[{number}/{len(VARIANTS)}] {label}: training {iterations} iterations ...", flush=True)
        log = train(demo, flags, iterations, eval_interval)
        validation = [(int(it), float(loss)) for it, loss in VALIDATION.findall(log)]
        imbalance = imbalance_curve(log)
        last = [value for _, value in imbalance[-4:]]  # the last 20 iterations
        results.append(
            {
                "label": label,
                "flags": flags,
                "validation": validation,
                "imbalance": imbalance,
                "final_validation_loss": validation[-1][1],
                "final_imbalance": sum(last) / len(last),
            }
        )
        print(
            f"    validation loss {validation[0][1]:.3f} -> {validation[-1][1]:.3f}, "
            f"imbalance over the last 20 iterations {results[-1]['final_imbalance']:.2f}",
            flush=True,
        )
    return results


def table(results: list[dict], iterations: int) -> str:
    lines = [
        f"{iterations} iterations of 16 x 256 tokens per run.",
        "",
        "| variant | final validation loss | imbalance, last 20 iterations (max/mean tokens per expert) |",
        "| --- | ---: | ---: |",
    ]
    lines += [f"| {r['label']} | {r['final_validation_loss']:.3f} | {r['final_imbalance']:.2f} |" for r in results]
    return "\n".join(lines)


def figures(record: dict) -> dict[str, "Figure"]:
    """The imbalance and validation-loss plots by file-name suffix, curves named by the table's
    numbers and labels, from the JSON record main() saves."""
    x_title = "iteration (16 x 256 tokens each)"

    def curves(key: str) -> list[Curve]:
        return [
            Curve(f"{number} {r['label']}", [(it, value) for it, value in r[key] if it > 0])
            for number, r in enumerate(record["runs"], start=1)
        ]

    return {
        "_imbalance": line_figure(
            curves("imbalance"),
            title=f"Expert-load imbalance per log interval, {record['train_iters']} iterations per run",
            x_title=x_title,
            y_title="max/mean tokens per expert (mean over MoE layers)",
        ),
        "_loss": line_figure(
            curves("validation"),
            title=f"Validation loss, {record['train_iters']} iterations per run",
            x_title=x_title,
            y_title="validation loss (cross-entropy, nats per token)",
            show_points=True,
        ),
    }


def write_plots(record: dict, output: Path) -> None:
    """OUTPUT_imbalance.png and OUTPUT_loss.png from a record as main() saves it to OUTPUT.json, so the
    plots can be redrawn without the runs."""
    for suffix, plot in figures(record).items():
        save_png(plot, output.with_name(output.name + suffix + ".png"))


def build_parser() -> FlagParser:
    parser = FlagParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--output",
        type=Path,
        default=Path("docs/balancing"),
        help="writes OUTPUT_imbalance.png, OUTPUT_loss.png and OUTPUT.json",
    )
    parser.add_argument("--demo-dir", type=Path, default=REPO / "demo_output", help="where `make demo` put the corpus")
    parser.add_argument("--train-iters", type=positive_int, default=200)
    parser.add_argument("--eval-interval", type=positive_int, default=50)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:  # before the runs, which take a while
        require_matplotlib()
    except UserError as error:
        sys.exit(f"error: {error}")
    if not (args.demo_dir / "corpus_text_document.idx").is_file():
        sys.exit(f"error: no demo corpus in {args.demo_dir}; run `make demo` first or give --demo-dir")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    results = study(args.demo_dir, args.train_iters, args.eval_interval)
    record = {"train_iters": args.train_iters, "runs": results}
    args.output.with_suffix(".json").write_text(json.dumps(record, indent=1))
    write_plots(record, args.output)
    print(table(results, args.train_iters))


if __name__ == "__main__":
    main()
