"""The data-efficiency studies of docs/quality.md, on the demo corpus with the demo's MoE model.

`--study optimizers`: Adam against 1-bit Adam and 0/1 Adam (and LAMB against 1-bit LAMB) at equal
steps and seed on 2 gloo ranks (torchrun), only the ds_config `optimizer` block differing.
`--study data`: the baseline against the legacy sequence-length curriculum, curriculum sampling by
vocabulary rarity (tools/analyze_data.py first), both together, and random-LTD, at equal
`--train-tokens` as Megatron-DeepSpeed counts them; the training wall time of each from its log.
Prints a Markdown table per study and writes OUTPUT.json. Run `make demo` first (it builds the corpus).

    python tools/data_efficiency_study.py --study optimizers data --output docs/data_efficiency
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

if importlib.util.find_spec("megatron") is None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron.config.parser import FlagParser, positive_int

REPO = Path(__file__).resolve().parent.parent
# the demo's model (examples_deepspeed/pretrain_gpt_demo.sh) and schedule, evaluated only at the end
MODEL = (
    "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --num-experts 8 --expert-interval 2 --topk 1 "
    "--moe-loss-coeff 0.01 --moe-train-capacity-factor 1.0 --moe-eval-capacity-factor 1.0 --moe-min-capacity 4 "
    "--micro-batch-size 8 --global-batch-size 16 --min-lr 1e-4 --lr-decay-style cosine --clip-grad 1.0 "
    "--hidden-dropout 0.0 --attention-dropout 0.0 --split 949,50,1 --num-workers 0 --log-interval 10 "
    "--eval-interval 1000000 --eval-iters 8 --seed 1234"
)
ADAM = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
LAMB = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "max_coeff": 10.0, "min_coeff": 0.01}
FREEZE = 40  # of 160 steps: a quarter of the run is warm-up, as in DeepSpeed's tutorials
OPTIMIZERS = [  # (label, the ds_config optimizer block)
    ("Adam", {"type": "Adam", "params": ADAM}),
    ("1-bit Adam", {"type": "OneBitAdam", "params": {**ADAM, "freeze_step": FREEZE}}),
    (
        "0/1 Adam",
        {
            "type": "ZeroOneAdam",
            "params": {**ADAM, "var_freeze_step": FREEZE, "local_step_scaler": 16, "local_step_clipper": 8},
        },
    ),
    # the scalers sized for this run: the variance updated at every warm-up step, replicas meeting every 2 steps
    (
        "0/1 Adam, local_step_clipper 2",
        {
            "type": "ZeroOneAdam",
            "params": {**ADAM, "var_freeze_step": FREEZE, "local_step_scaler": 16, "local_step_clipper": 2},
        },
    ),
    (
        "0/1 Adam, var_update_scaler 64, local_step_clipper 2",
        {
            "type": "ZeroOneAdam",
            "params": {
                **ADAM,
                "var_freeze_step": FREEZE,
                "var_update_scaler": 64,
                "local_step_scaler": 16,
                "local_step_clipper": 2,
            },
        },
    ),
    ("LAMB", {"type": "Lamb", "params": LAMB}),
    ("1-bit LAMB", {"type": "OneBitLamb", "params": {**LAMB, "freeze_step": FREEZE}}),
]
SEQ = 256
# curricula over the first 30% of the baseline's iterations
CURRICULUM_STEPS = 60
SEQLEN = {
    "min_difficulty": 32,
    "max_difficulty": SEQ,
    "schedule_type": "fixed_linear",
    "schedule_config": {"total_curriculum_step": CURRICULUM_STEPS, "difficulty_step": 8},
}
RARITY = {
    "index_to_sample_path": "ANALYSIS/vocab_rarity/vocab_rarity_index_to_sample_percentile_merged",
    "index_to_metric_path": "ANALYSIS/vocab_rarity/vocab_rarity_index_to_metric",
    "difficulty_type": "percentile",
    "clustering_type": "schedule_based",
    "min_difficulty": 1,
    "max_difficulty": 100,
    "schedule_type": "fixed_root",
    "schedule_config": {"total_curriculum_step": CURRICULUM_STEPS, "difficulty_step": 1, "root_degree": 2},
}
TRUNCATE = {
    "index_to_sample_path": "dummy",
    "index_to_metric_path": "dummy",
    "difficulty_type": "value",
    "clustering_type": "single_cluster",
    **SEQLEN,
}


def sampling(metrics: dict) -> dict:
    return {
        "data_efficiency": {
            "enabled": True,
            "seed": 1234,
            "data_sampling": {
                "enabled": True,
                "num_workers": 0,
                "curriculum_learning": {
                    "enabled": True,
                    "data_cluster_path": "clusters",
                    "curriculum_metrics": metrics,
                },
            },
        }
    }


RANDOM_LTD = {
    "data_efficiency": {
        "enabled": True,
        "seed": 1234,
        "data_routing": {
            "enabled": True,
            "random_ltd": {
                "enabled": True,
                "total_layer_num": 4,
                "random_ltd_layer_num": 2,
                "random_ltd_layer_id": [1, 2],  # the middle layers, as DeepSpeed's GPT recipes keep the ends whole
                "model_mask_name": "attention_mask",
                "model_type": "decoder",
                "hidden_state_order": "seq_batch_dim",
                "random_ltd_schedule": {
                    "min_value": 64,
                    "max_value": SEQ,
                    "schedule_type": "fixed_linear",
                    "schedule_config": {"require_steps": 100, "seq_per_step": 16},
                },
            },
        },
    }
}
DATA_VARIANTS = [  # (label, ds_config, its flag, needs the analysis)
    ("baseline", {}, [], False),
    ("seqlen curriculum (legacy block)", {"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", **SEQLEN}},
     ["--curriculum-learning-legacy"], False),
    ("vocab-rarity curriculum sampling", sampling({"vocabularyrarity": RARITY}),
     ["--data-efficiency-curriculum-learning"], True),
    ("seqlen truncation + vocab rarity", sampling({"vocabularyrarity": RARITY, "seqlen_truncate": TRUNCATE}),
     ["--data-efficiency-curriculum-learning"], True),
    ("random-LTD (layers 1-2, 64 -> 256)", RANDOM_LTD, ["--random-ltd"], False),
]  # fmt: skip
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")
LOG_LINE = re.compile(
    r"^ iteration +(\d+)/ *\d+ \| consumed samples: +(\d+) \| consumed tokens: +(\d+) \| "
    r"elapsed time per iteration \(ms\): ([0-9.]+)",
    re.M,
)


@dataclass
class Run:
    label: str
    ds_config: dict
    iterations: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0
    validation_loss: float = 0.0
    train_seconds: float = 0.0  # the iterations' time from the log, without start-up and evaluation
    process_seconds: float = 0.0
    ms_per_iteration: list[float] = field(default_factory=list)


def summarise(run: Run, log: str, seconds: float) -> Run:
    lines = [(int(i), int(s), int(t), float(ms)) for i, s, t, ms in LOG_LINE.findall(log)]
    validation = VALIDATION.findall(log)
    if not lines or not validation:
        sys.exit(f"error: {run.label}: no log lines or validation loss in its output:\n{log[-3000:]}")
    run.iterations, run.consumed_samples, run.consumed_tokens = lines[-1][:3]
    run.validation_loss = float(validation[-1][1])
    previous = 0
    for iteration, _, _, ms in lines:
        run.train_seconds += (iteration - previous) * ms / 1000
        run.ms_per_iteration.append(ms)
        previous = iteration
    run.process_seconds = seconds
    return run


def train(command: list[str], label: str, ds_config: dict, work: Path) -> Run:
    config = work / (re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_") + ".json")
    config.write_text(json.dumps({**ds_config, "train_batch_size": 16}))
    began = time.perf_counter()
    done = subprocess.run([*command, "--deepspeed", "--deepspeed_config", str(config)],
                          capture_output=True, text=True, cwd=REPO)  # fmt: skip
    seconds = time.perf_counter() - began
    if done.returncode:
        sys.exit(f"error: {label} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return summarise(Run(label, ds_config), done.stdout, seconds)


def data_flags(demo: Path) -> list[str]:
    tokenizer, data = str(demo / "tokenizer.model"), str(demo / "corpus_text_document")
    return ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tokenizer, "--data-path", data]


def optimizer_study(demo: Path, work: Path, iterations: int) -> list[Run]:
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29617"]
    flags = [*MODEL.split(), "--seq-length", "128", "--train-iters", str(iterations)]
    flags += ["--lr-warmup-iters", str(max(1, iterations // 5))]  # 32 of the 160
    runs = []
    for number, (label, block) in enumerate(OPTIMIZERS, start=1):
        print(f"[{number}/{len(OPTIMIZERS)}] {label}: {iterations} iterations on 2 ranks ...", flush=True)
        runs.append(train([*launch, "pretrain_gpt.py", *flags, *data_flags(demo)], label, {"optimizer": block}, work))
        print(f"    validation loss {runs[-1].validation_loss:.4f}", flush=True)
    return runs


def with_analysis(ds_config: dict, analysis: Path) -> dict:
    return json.loads(json.dumps(ds_config).replace("ANALYSIS", str(analysis)))


def data_study(demo: Path, work: Path, train_tokens: int) -> list[Run]:
    warmup = train_tokens // 20  # 5% of the tokens, in tokens so a curriculum's short sequences count as trained
    flags = [*MODEL.split(), "--seq-length", str(SEQ), "--train-tokens", str(train_tokens), "--lr", "1e-3",
             "--weight-decay", "0.1", "--adam-beta2", "0.95", "--lr-warmup-tokens", str(warmup), *data_flags(demo)]  # fmt: skip
    runs = []
    for number, (label, ds_config, extra, analysed) in enumerate(DATA_VARIANTS, start=1):
        config = ds_config
        if analysed:
            analysis = work / f"analysis{number}"
            print(f"[{number}/{len(DATA_VARIANTS)}] {label}: analysing the training samples ...", flush=True)
            config = with_analysis(ds_config, analysis)
            path = work / f"analysis{number}.json"
            path.write_text(json.dumps({**config, "train_batch_size": 16}))
            analyse = [sys.executable, "tools/analyze_data.py", "--analyzing-metric", "vocab_rarity", "--save",
                       str(analysis), *flags, *extra, "--deepspeed", "--deepspeed_config", str(path)]  # fmt: skip
            done = subprocess.run(analyse, capture_output=True, text=True, cwd=REPO)
            if done.returncode:
                sys.exit(f"error: the analysis failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        print(f"[{number}/{len(DATA_VARIANTS)}] {label}: {train_tokens:,} tokens ...", flush=True)
        runs.append(train([sys.executable, "pretrain_gpt.py", *flags, *extra], label, config, work))
        r = runs[-1]
        done_line = f"{r.iterations} iterations, validation loss {r.validation_loss:.4f}, {r.train_seconds:.0f} s"
        print("    " + done_line, flush=True)
    return runs


def table(runs: list[Run], baseline: Run) -> str:
    lines = [
        "| variant | iterations | sequences read | tokens counted | validation loss | vs baseline | "
        "training s | time ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r.label} | {r.iterations} | {r.consumed_samples:,} | {r.consumed_tokens:,} | {r.validation_loss:.4f} | "
        f"{100 * (r.validation_loss / baseline.validation_loss - 1):+.2f}% | {r.train_seconds:.1f} | "
        f"{r.train_seconds / baseline.train_seconds:.2f} |"
        for r in runs
    ]
    return "\n".join(lines)


def build_parser() -> FlagParser:
    parser = FlagParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", nargs="+", choices=["optimizers", "data"], default=["optimizers", "data"])
    parser.add_argument("--output", type=Path, default=Path("docs/data_efficiency"), help="writes OUTPUT.json")
    parser.add_argument("--demo-dir", type=Path, default=REPO / "demo_output", help="where `make demo` put the corpus")
    parser.add_argument(
        "--work-dir", type=Path, default=REPO / "demo_output" / "data_efficiency_study", help="ds_configs, analyses"
    )
    parser.add_argument("--optimizer-iters", type=positive_int, default=160)
    parser.add_argument("--train-tokens", type=positive_int, default=200 * 16 * SEQ, help="the data study's, per run")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if not (args.demo_dir / "corpus_text_document.idx").is_file():
        sys.exit(f"error: no demo corpus in {args.demo_dir}; run `make demo` first or give --demo-dir")
    shutil.rmtree(args.work_dir, ignore_errors=True)
    args.work_dir.mkdir(parents=True)
    record: dict[str, object] = {}
    if "optimizers" in args.study:
        runs = optimizer_study(args.demo_dir.resolve(), args.work_dir.resolve(), args.optimizer_iters)
        record["optimizers"] = {"iterations": args.optimizer_iters, "runs": [asdict(r) for r in runs]}
        print(table(runs, runs[0]))
    if "data" in args.study:
        runs = data_study(args.demo_dir.resolve(), args.work_dir.resolve(), args.train_tokens)
        record["data"] = {"train_tokens": args.train_tokens, "runs": [asdict(r) for r in runs]}
        print(table(runs, runs[0]))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.with_suffix(".json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
