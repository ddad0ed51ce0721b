"""Resident memory (RSS) over training iterations of a tiny MoE GPT, with and without the padding of
the experts' rows (megatron/model/moe/experts.py, `padded_rows`), and of the dense GPT of the same
shape: the memory that should stay flat (issue 13).

Without the padding the MoE run grows by megabytes per iteration for hundreds of iterations: on
the CPU, torch runs GELU through oneDNN, which compiles and caches a kernel for every new input
shape, and the experts' GELU sees a new row count almost every step. Each kernel's small
long-lived allocations land in the holes that freed activations leave in glibc's heap, so those
holes can be neither reused for the next large tensor nor returned to the system.

Each variant trains in a fresh process (fragmentation is a property of the process's history),
calling Trainer.train_step and reading the MoE monitor once per 10 iterations as Trainer.train
does; the data loader runs in the process. Variants run interleaved in rounds; RSS columns are the
medians over rounds, the step-time ratio the median of per-round ratios of steady-state (after
iteration 100) median step times. Prints a table and writes JSON (default
benchmarks/results/memory.json). Linux only: RSS is read from /proc.
"""

import argparse
import io
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import torch

from benchmarks.moe_layer import cpu_name, proc_status_bytes
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype
from megatron.model.moe import experts
from megatron.parallel import build_parallel_grid
from megatron.training.loop import Trainer
from tests.training_fixtures import tiny_config
from tools.build_demo_corpus import stdlib_sources

VARIANTS = ("moe", "moe-unpadded", "dense")
# the tiny CPU recipe (examples_deepspeed/MoE/ds_pretrain_gpt_tiny_MoE_cpu.sh) with the demo's vocabulary size
SHAPE = dict(
    num_layers=8,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=128,
    max_position_embeddings=128,
    micro_batch_size=8,
    global_batch_size=8,
    vocab_size=4000,
    lr=2e-3,
    min_lr=2e-4,
    lr_warmup_iters=10,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    num_workers=0,
)
MOE = dict(num_experts=8, expert_interval=2, topk=1, moe_train_capacity_factor=1.0, moe_min_capacity=4)
MONITOR_INTERVAL = 10
STEADY_FROM = 100  # iteration from which step times count and against which growth is measured
TABLE_ITERATIONS = (1, 10, 30, 100, 200, 300, 500, 700, 1000, 1500, 2000)


def write_text_corpus(folder: Path, megabytes: float = 2.0) -> str:
    """The demo's text (the standard library's sources) as bytes, one token per byte. Real text
    matters here: its routing keeps changing, so the experts see new row counts for hundreds of
    steps, where a synthetic corpus settles within a few dozen."""
    prefix = str(folder / "text_document")
    vocab = SHAPE["vocab_size"]  # the demo's size, for its logits' size
    eod = vocab - 1  # NullTokenizer's: the last id
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", best_fitting_dtype(vocab), vocab_size=vocab)
    budget = int(megabytes * 2**20)
    for path in stdlib_sources():
        text = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        builder.add_item(np.append(text.astype(np.int64), eod))
        builder.end_document()
        budget -= len(text)
        if budget <= 0:
            break
    builder.finalize(prefix + ".idx")
    return prefix


def train_and_sample(variant: str, corpus: str, iterations: int) -> dict[str, list[float]]:
    """Train `iterations` steps of `variant` in this process: RSS (bytes) and seconds of each step."""
    if variant == "moe-unpadded":
        experts.padded_rows = lambda rows: rows  # the code before the fix, for this process only
    overrides = {**SHAPE, **(MOE if variant != "dense" else {})}
    config = tiny_config(corpus, train_iters=iterations, **overrides)
    with redirect_stdout(io.StringIO()):
        trainer = Trainer(config, build_parallel_grid(torch.device("cpu")))
    data_iter = trainer.loader(trainer.train_data, 0)
    rss, seconds = [], []
    for iteration in range(1, iterations + 1):
        start = time.perf_counter()
        trainer.train_step(data_iter)
        seconds.append(time.perf_counter() - start)
        if iteration % MONITOR_INTERVAL == 0:
            trainer.moe_monitor.report(trainer.grid.dp_group)
        rss.append(proc_status_bytes("VmRSS"))
    return {"rss_bytes": rss, "step_s": seconds}


def run_child(variant: str, corpus: str, iterations: int) -> dict[str, list[float]]:
    """`train_and_sample` in a fresh Python process, so that its allocator starts clean."""
    cmd = [sys.executable, "-m", "benchmarks.memory", "--child", variant, corpus, "--iterations", str(iterations)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{variant} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(variant: str, runs: list[dict[str, list[float]]]) -> dict:
    """Per variant: median RSS over rounds at each iteration, growth after STEADY_FROM, step time."""
    mib = [[b / 2**20 for b in run["rss_bytes"]] for run in runs]
    rss = [statistics.median(values) for values in zip(*mib)]
    base = rss[min(STEADY_FROM, len(rss)) - 1]
    steady = [statistics.median(run["step_s"][STEADY_FROM:] or run["step_s"]) for run in runs]
    return {
        "variant": variant,
        "rss_mib": rss,
        "rss_at_base_mib": base,
        "rss_end_mib": rss[-1],
        "end_over_base": rss[-1] / base,
        "max_over_base": max(rss[STEADY_FROM - 1 :] or rss) / base,
        "step_ms_per_round": [1000 * s for s in steady],
        "step_ms": 1000 * statistics.median(steady),
    }


def step_ratio(rows: dict[str, dict], numerator: str, denominator: str) -> float | None:
    if numerator not in rows or denominator not in rows:
        return None
    pairs = zip(rows[numerator]["step_ms_per_round"], rows[denominator]["step_ms_per_round"])
    return statistics.median(n / d for n, d in pairs)


def print_table(rows: dict[str, dict], iterations: int, padded_over_unpadded: float | None) -> None:
    names = list(rows)
    print(f"RSS MiB (median of rounds) by iteration; growth from iteration {STEADY_FROM}")
    print(f"{'iteration':>9} " + " ".join(f"{name:>13}" for name in names))
    for it in [i for i in TABLE_ITERATIONS if i < iterations] + [iterations]:
        print(f"{it:9d} " + " ".join(f"{rows[name]['rss_mib'][it - 1]:13.0f}" for name in names))
    print(f"{'end/base':>9} " + " ".join(f"{rows[name]['end_over_base']:13.3f}" for name in names))
    print(f"{'max/base':>9} " + " ".join(f"{rows[name]['max_over_base']:13.3f}" for name in names))
    print(f"{'step ms':>9} " + " ".join(f"{rows[name]['step_ms']:13.1f}" for name in names))
    if padded_over_unpadded is not None:
        print(f"step time moe / moe-unpadded (median of per-round ratios): {padded_over_unpadded:.3f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--output", default="benchmarks/results/memory.json")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "CORPUS"), help=argparse.SUPPRESS)  # internal
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.child:
        print(json.dumps(train_and_sample(args.child[0], args.child[1], args.iterations)))
        return
    runs: dict[str, list[dict]] = {name: [] for name in args.variants}
    with tempfile.TemporaryDirectory() as folder:
        corpus = write_text_corpus(Path(folder))
        for round_number in range(1, args.rounds + 1):
            for name in args.variants:
                runs[name].append(run_child(name, corpus, args.iterations))
                print(f"round {round_number}/{args.rounds}: {name} done", file=sys.stderr, flush=True)
    rows = {name: summarise(name, variant_runs) for name, variant_runs in runs.items()}
    ratio = step_ratio(rows, "moe", "moe-unpadded")
    print(
        f"tiny GPT {SHAPE['num_layers']}x{SHAPE['hidden_size']}, MoE {MOE['num_experts']} experts every other "
        f"layer top-{MOE['topk']}, {torch.get_num_threads()} threads, {args.rounds} round(s)"
    )
    print_table(rows, args.iterations, ratio)
    report = {
        "machine": platform.machine(),
        "processor": cpu_name(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
        "args": {k: v for k, v in vars(args).items() if k != "child"},
        "step_ms_moe_over_unpadded": ratio,
        "rows": rows,
        "runs": {name: [run["rss_bytes"] for run in variant_runs] for name, variant_runs in runs.items()},
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
