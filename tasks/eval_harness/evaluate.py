"""Zero-shot (or few-shot) evaluation of a checkpoint with lm-eval:

    python tasks/eval_harness/evaluate.py --load CKPT --tasks lambada_local,piqa_local \\
        [--num_fewshot 0] [--batch_size 8] [--limit N] [--output_path eval_results]

writes lm-eval's results JSON and a markdown table in the paper's layout to --output_path. lm-eval
is an optional extra (`pip install .[eval]`). The two shipped tasks (tasks/*.yaml, data read from
--task-data-dir) also run without it, zero-shot, scored by megatron/inference/local_tasks.py to the
same accuracy.
"""

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:  # run as a script: make `megatron` and `tasks` importable
    sys.path.insert(0, ROOT)

from megatron.config.parser import FlagParser, non_negative_int, positive_float, positive_int  # noqa: E402
from megatron.entry_point import run_entry_point  # noqa: E402
from megatron.errors import ConfigError  # noqa: E402
from megatron.inference.checkpoint_model import (  # noqa: E402
    LoadedModel,
    add_load_args,
    inference_grid,
    load_from_args,
)
from megatron.inference.jsonl import read_jsonl  # noqa: E402
from megatron.inference.local_tasks import last_word_accuracy, two_choice_accuracy  # noqa: E402
from tasks.eval_harness.report import markdown_table  # noqa: E402

HERE = Path(__file__).resolve().parent
LOCAL_TASKS = {
    "lambada_local": (("text",), last_word_accuracy),
    "piqa_local": (("goal", "sol1", "sol2", "label"), two_choice_accuracy),
}
INSTALL_HINT = "lm-eval is not installed; install it with `pip install .[eval]` (or `pip install lm-eval`)"


def build_parser() -> FlagParser:
    parser = FlagParser(description="Evaluate a checkpoint with lm-eval.")
    add_load_args(parser)
    g = parser.add_argument_group("evaluation (lm-eval's flags)")
    g.add_argument("--tasks", required=True, help="comma-separated lm-eval task names, e.g. lambada_local,piqa_local")
    g.add_argument("--num_fewshot", "--num-fewshot", type=non_negative_int, default=0)
    g.add_argument("--batch_size", "--batch-size", type=positive_int, default=8)
    g.add_argument(
        "--limit", type=positive_float, default=None, help="at most N examples per task (below 1: a fraction)"
    )
    g.add_argument(
        "--output_path", "--output-path", default="eval_results", help="folder for results.json and results.md"
    )
    g.add_argument("--task-data-dir", default=str(HERE / "data"), help="folder of TASK.jsonl for the local tasks")
    return parser


def local_task_configs(names: list[str], data_dir: str) -> list[dict[str, Any]]:
    """The shipped YAML task definitions, reading their data from `data_dir`."""
    import yaml  # comes with lm-eval

    configs = []
    for name in names:
        config = yaml.safe_load((HERE / "tasks" / f"{name}.yaml").read_text())
        config["dataset_kwargs"] = {"data_files": {"test": str(Path(data_dir) / f"{name}.jsonl")}}
        configs.append(config)
    return configs


def run_lm_eval(loaded: LoadedModel, tasks: list[str], args: argparse.Namespace) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.utils import handle_non_serializable

    from tasks.eval_harness.lm_adapter import MegatronLM

    specs = [t for t in tasks if t not in LOCAL_TASKS] + local_task_configs(
        [t for t in tasks if t in LOCAL_TASKS], args.task_data_dir
    )
    limit = None if args.limit is None else int(args.limit) if args.limit >= 1 else args.limit
    results = simple_evaluate(
        model=MegatronLM(loaded, args.batch_size),
        tasks=specs,
        num_fewshot=args.num_fewshot,
        limit=limit,
        batch_size=args.batch_size,
    )
    return json.loads(json.dumps(results, default=handle_non_serializable))


def run_local(loaded: LoadedModel, tasks: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The shipped tasks without lm-eval, in the layout of lm-eval's results."""
    if args.num_fewshot:
        raise ConfigError(f"--num_fewshot {args.num_fewshot} needs lm-eval; {INSTALL_HINT}, or use --num_fewshot 0")
    results = {}
    for task in tasks:
        fields, accuracy = LOCAL_TASKS[task]
        docs = read_jsonl(Path(args.task_data_dir) / f"{task}.jsonl", fields)
        if args.limit is not None:
            docs = docs[: int(args.limit) if args.limit >= 1 else max(1, int(args.limit * len(docs)))]
        results[task] = {
            "acc,none": accuracy(loaded.model, loaded.tokenizer, docs, args.batch_size),
            "samples": len(docs),
        }
    return {"results": results, "config": {"scorer": "megatron.inference.local_tasks", "num_fewshot": 0}}


def lm_eval_installed() -> bool:
    return importlib.util.find_spec("lm_eval") is not None


def evaluate(args: argparse.Namespace) -> None:
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    has_lm_eval = lm_eval_installed()
    if not has_lm_eval and not set(tasks) <= set(LOCAL_TASKS):
        raise ConfigError(f"{INSTALL_HINT} to run {', '.join(t for t in tasks if t not in LOCAL_TASKS)}")
    if args.batch_size < 1:
        raise ConfigError(f"--batch_size must be at least 1, got {args.batch_size}")
    grid = inference_grid()
    loaded = load_from_args(args, grid)
    results = run_lm_eval(loaded, tasks, args) if has_lm_eval else run_local(loaded, tasks, args)
    if grid.is_first_rank:
        out = Path(args.output_path)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=2))
        table = markdown_table(results, f"{loaded.folder.parent.name} iteration {loaded.iteration}")
        (out / "results.md").write_text(table)
        print(table + f"\n > wrote {out / 'results.json'} and {out / 'results.md'}", flush=True)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local task files only: never wait on a hub
    run_entry_point(lambda: evaluate(build_parser().parse_args(argv)))


if __name__ == "__main__":
    main()
