"""Convergence of DeepSpeed's communication-compressed optimizers (OneBitAdam, ZeroOneAdam,
OneBitLamb) against AdamW on the built-in demo corpus. Issue target: validation loss within 2% of
Adam's.

Each optimizer trains the demo's MoE GPT (4 layers, hidden 256, 8 experts every other layer, top-1;
here at sequence length 128 so that a run fits ~4 minutes on 2 cores) through pretrain_gpt.py under
torchrun on 2 gloo ranks (data-parallel 2, ZeRO stage 0), from the same seed on the same data for the
same iterations and tokens, with the same Megatron LR schedule (linear warm-up over --warmup-fraction
of the run, cosine decay to lr / 10). Only the ds_config's optimizer block differs. The compressed
phases start at --freeze-fraction of the run (freeze_step, var_freeze_step), a little after the
warm-up ends, as DeepSpeed's docs advise. 0/1 Adam gets a small local_step_scaler so that its local
steps (1, 2, 4, then up to local_step_clipper steps between synchronisations) happen within the run.
Plain Lamb runs as the reference for OneBitLamb (the LAMB update itself differs from Adam's).

Measured per run: the last validation loss (the evaluation after the final iteration), the training
lm loss of the last log interval (its mean over --log-interval iterations), its ratio to AdamW's, the
wall time of the whole torchrun command (start-up included) and the mean time per iteration from the
log. Prints a Markdown table and writes JSON (default benchmarks/results/onebit_convergence.json)
with the machine, the git commit, the exact command lines and every run's loss curves.

Build the data first, as examples_deepspeed/pretrain_gpt_demo.sh does (`make demo` leaves it in
demo_output/), then: python -m benchmarks.onebit_convergence --data-prefix DIR/corpus_text_document
--tokenizer-model DIR/tokenizer.model
"""

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.aio import REPO, machine
from benchmarks.data_checksum import cpu_flags
from megatron.parallel import free_port

OPTIMIZERS = ("AdamW", "OneBitAdam", "ZeroOneAdam", "Lamb", "OneBitLamb")
# the demo's model (examples_deepspeed/pretrain_gpt_demo.sh) at half its sequence length
SEQ_LENGTH, GLOBAL_BATCH = 128, 16  # micro-batch 8 on each of the 2 ranks, no accumulation
MODEL_FLAGS = shlex.split(
    f"--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length {SEQ_LENGTH} "
    "--num-experts 8 --expert-interval 2 --topk 1 --moe-loss-coeff 0.01 "
    "--moe-train-capacity-factor 1.0 --moe-eval-capacity-factor 1.0 --moe-min-capacity 4 "
    f"--micro-batch-size 8 --global-batch-size {GLOBAL_BATCH} --clip-grad 1.0 --hidden-dropout 0.0 --attention-dropout 0.0"
)
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+) \|")
ITERATION = re.compile(
    r"^ iteration +(\d+)/ *\d+ \|.*elapsed time per iteration \(ms\): (\S+) \|.*\| lm loss: (\S+) \|", re.M
)
SKIPPED = re.compile(r"number of skipped iterations: +(\d+)")
# the optimizers' own one-time lines (when compression or local steps start) and anything alarming
NOTABLE = re.compile(r"compressed communication|variance frozen|warning|error|nan|inf\b", re.I)


def optimizer_block(name: str, args: argparse.Namespace, freeze: int) -> dict[str, Any]:
    lamb = "Lamb" in name
    params: dict[str, Any] = {
        "lr": args.lamb_lr if lamb else args.lr,
        "betas": [0.9, 0.95],  # the demo's --adam-beta2 0.95
        "eps": 1e-8,
        "weight_decay": 0.1,
    }
    if name == "OneBitAdam":
        params["freeze_step"] = freeze
    elif name == "ZeroOneAdam":
        # var_update_scaler: DeepSpeed's 16. local_step_scaler 16 (DeepSpeed: 32678, i.e. never within
        # a short run): the interval between synchronisations doubles every 16 local steps up to 8
        params |= {"var_freeze_step": freeze, "var_update_scaler": 16, "local_step_scaler": 16, "local_step_clipper": 8}
    elif name == "OneBitLamb":  # DeepSpeed's defaults, written out so that the JSON reports them
        params |= {"freeze_step": freeze, "max_coeff": 10.0, "min_coeff": 0.01, "coeff_beta": 0.9}
        params |= {"factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1}
    elif name == "Lamb":
        params |= {"max_coeff": 10.0, "min_coeff": 0.01}
    return {"type": name, "params": params}


def command(name: str, args: argparse.Namespace, config: Path) -> list[str]:
    lr = args.lamb_lr if "Lamb" in name else args.lr
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),  # not torchrun's fixed 29500: another run on the machine may hold it
        "pretrain_gpt.py",
        *MODEL_FLAGS,
        *f"--train-iters {args.iters} --lr-warmup-iters {round(args.warmup_fraction * args.iters)}".split(),
        *f"--lr-decay-style cosine --min-lr {lr / 10:g} --seed {args.seed}".split(),
        *f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {args.tokenizer_model}".split(),
        *f"--data-path {args.data_prefix} --split 949,50,1 --num-workers 0".split(),
        *f"--log-interval {args.log_interval} --eval-interval {args.eval_interval} --eval-iters {args.eval_iters}".split(),
        *f"--deepspeed --deepspeed_config {config}".split(),
    ]


def run(name: str, args: argparse.Namespace) -> dict[str, Any]:
    freeze = round(args.freeze_fraction * args.iters)
    config = {"zero_optimization": {"stage": 0}, "optimizer": optimizer_block(name, args, freeze)}
    path = args.work_dir / f"{name}.json"
    path.write_text(json.dumps(config, indent=1))
    argv = command(name, args, path)
    # one torch thread per rank: 2 ranks on 2 cores; idle threads sleep (as the demo sets them)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": "PASSIVE"}
    load_before = os.getloadavg()[0]
    began = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - began
    log = done.stdout + done.stderr
    (args.work_dir / f"{name}.log").write_text(log)
    validation = [(int(it), float(loss)) for it, loss in VALIDATION.findall(log)]
    iterations = [(int(it), float(ms), float(loss)) for it, ms, loss in ITERATION.findall(log)]
    skipped = [int(n) for n in SKIPPED.findall(log)]
    step_ms = [ms for _, ms, _ in iterations[1:]]  # the first interval includes warm-up
    result = {
        "optimizer": name,
        "ds_config": config,
        "command": shlex.join(argv),
        "returncode": done.returncode,
        "wall_s": wall,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
        "ms_per_iteration": sum(step_ms) / len(step_ms) if step_ms else None,
        "validation": validation,
        "train": [(it, loss) for it, _, loss in iterations],
        "final_validation_loss": validation[-1][1] if validation else None,
        "final_train_loss": iterations[-1][2] if iterations else None,
        "last_iteration": iterations[-1][0] if iterations else 0,
        "skipped_iterations": sum(skipped),
        "notable_lines": sorted({line.strip() for line in log.splitlines() if NOTABLE.search(line)})[:20],
    }
    if done.returncode:
        result["log_tail"] = log[-4000:]
    return result


def table(runs: list[dict[str, Any]]) -> str:
    def number(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        "| optimizer | LR | final val loss | val / AdamW | within 2% | final train loss | train / AdamW "
        "| wall s | ms/iter | status |",
        "| --- | ---: | ---: | ---: | :---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in runs:
        within = "-" if r["val_ratio"] is None else ("yes" if r["val_ratio"] <= 1.02 else "no")
        lines.append(
            f"| {r['optimizer']} | {r['ds_config']['optimizer']['params']['lr']:g} "
            f"| {number(r['final_validation_loss'], '.4f')} | {number(r['val_ratio'], '.4f')} | {within} "
            f"| {number(r['final_train_loss'], '.4f')} | {number(r['train_ratio'], '.4f')} "
            f"| {r['wall_s']:.0f} | {number(r['ms_per_iteration'], '.0f')} | {r['status']} |"
        )
    return "\n".join(lines)


def git_commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--data-prefix", default="demo_output/corpus_text_document", help="tools/preprocess_data.py's output prefix"
    )
    parser.add_argument(
        "--tokenizer-model", default="demo_output/tokenizer.model", help="the demo's SentencePiece model"
    )
    parser.add_argument("--iters", type=int, default=200, help="training iterations per run")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak LR of the Adam-type optimizers (the demo's)")
    parser.add_argument("--lamb-lr", type=float, default=1e-3, help="peak LR of Lamb and OneBitLamb")
    parser.add_argument("--warmup-fraction", type=float, default=0.2, help="of --iters: the LR warm-up")
    parser.add_argument("--freeze-fraction", type=float, default=0.25, help="of --iters: freeze_step, var_freeze_step")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--eval-interval", type=int, default=50)
    parser.add_argument("--eval-iters", type=int, default=10, help="validation batches per evaluation")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (OMP_NUM_THREADS)")
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/onebit_convergence"), help="ds_configs and logs")
    parser.add_argument("--output", default="benchmarks/results/onebit_convergence.json")
    args = parser.parse_args()
    args.data_prefix, args.tokenizer_model = Path(args.data_prefix).resolve(), Path(args.tokenizer_model).resolve()
    args.work_dir = args.work_dir.resolve()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    runs = []
    for name in args.optimizers:
        print(f"== {name}: training {args.iters} iterations ...", flush=True)
        runs.append(run(name, args))
        r = runs[-1]
        print(f"   rc {r['returncode']}, validation {r['validation']}, {r['wall_s']:.0f} s", flush=True)
    baseline = next((r for r in runs if r["optimizer"] == "AdamW" and r["final_validation_loss"]), None)
    for r in runs:
        for key, ratio in (("final_validation_loss", "val_ratio"), ("final_train_loss", "train_ratio")):
            ok = baseline is not None and r[key] is not None and math.isfinite(r[key])
            r[ratio] = r[key] / baseline[key] if ok else None
        finished = r["returncode"] == 0 and r["last_iteration"] == args.iters
        r["status"] = "ok" if finished and r["val_ratio"] is not None else f"failed (rc {r['returncode']})"
    print(table(runs))
    info = machine(args.work_dir) | {"cpu_flags": cpu_flags(), "load_average_end": os.getloadavg()}
    result = {
        "machine": info,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "git_commit": git_commit(),
        "benchmark_command": shlex.join([sys.executable, "-m", "benchmarks.onebit_convergence", *sys.argv[1:]]),
        "args": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "tokens_per_run": args.iters * GLOBAL_BATCH * SEQ_LENGTH,
        "total_wall_s": time.perf_counter() - began,
        "runs": runs,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    print(f"total {result['total_wall_s']:.0f} s; wrote {args.output}")


if __name__ == "__main__":
    main()
