"""Data against tensor parallelism on the same 2 gloo ranks (one thread each): step time and
per-rank memory of one dense GPT under DP=2, TP=2 and TP=2 with sequence parallelism, each trained
through the Trainer (megatron.training) from the flags a user would give, ZeRO stage 0, fp32.

Every layout trains the same global batch (micro batch 2 x 2 = 4 sequences a step): DP=2 runs one
micro-batch per rank, TP=2 runs two micro-batches (gradient accumulation) through both ranks. So the
step times compare the same work, and the activations (per micro-batch) compare the same micro batch.

Each (layout, round) is its own run_distributed call: fresh processes, so the RSS peaks do not mix.
Layouts alternate in rounds (the order reversed every other round) so machine drift hits them
alike. Step time: forward + backward + optimizer step of the whole global batch, the slower rank's,
median over the timed steps after warm-up; the ratio to DP=2 is the median of per-round ratios.
The batches are read from the corpus before timing starts.

Memory per rank, from the engine's tensors: parameters (split over the tensor-parallel group, and
held whole by every rank: norms, row-parallel biases, position embeddings), gradients when the
optimizer steps, optimizer state; the process's peak RSS above its RSS before the Trainer was built
(VmHWM after clear_refs); and activations: the bytes autograd saves for backward during one
micro-batch's forward (torch.autograd.graph.saved_tensors_hooks): the storages they hold alive,
parameters and views of them not counted.

Pipeline parallelism (PP=2) has a row reserved: `pipeline_row` says what it takes to run it (the
flags accepting --pipeline-model-parallel-size 2, and rank_run measuring stages), and its row then
adds the bubble (P-1)/(m+P-1); until then one line says why it is skipped.

Prints a table and writes JSON (default benchmarks/results/parallel.json).
"""

import argparse
import contextlib
import io
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from benchmarks.moe_layer import cpu_name, proc_status_bytes
from benchmarks.zero import tensor_bytes
from megatron.config.flags import PretrainConfig
from megatron.errors import ConfigError
from megatron.model.tensor_parallel import tensor_parallel_split
from megatron.parallel import build_parallel_grid
from megatron.training import Trainer, gpt_batch, lm_loss
from tests.dist_utils import run_distributed
from tests.training_fixtures import tiny_config, write_corpus

RANKS, MICRO_BATCH = 2, 2
GLOBAL_BATCH = MICRO_BATCH * RANKS
# 8,191 token ids + the NullTokenizer's eod = 8,192: a multiple of 128 x TP, so no layout pads it
VOCAB = 8191
MODEL = dict(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=256, hidden_dropout=0.0,
             attention_dropout=0.0)
MEMORY_KEYS = ("param_bytes", "split_param_bytes", "whole_param_bytes", "grad_bytes", "optim_bytes",
               "activation_bytes", "peak_rss_delta")


class Layout(NamedTuple):
    name: str
    tp_size: int = 1
    pp_size: int = 1
    sequence_parallel: bool = False

    @property
    def dp_size(self) -> int:
        return RANKS // (self.tp_size * self.pp_size)


BASELINE = Layout("DP=2")
LAYOUTS = (BASELINE, Layout("TP=2", tp_size=2), Layout("TP=2+SP", tp_size=2, sequence_parallel=True))
# the reserved row (see pipeline_row): True once rank_run measures pipeline stages
PIPELINE, MEASURES_PIPELINE = Layout("PP=2", pp_size=2), False


def layout_config(corpus: str, layout: Layout, train_iters: int) -> PretrainConfig:
    """The flags of one layout; raises ConfigError where the layout is not built."""
    return tiny_config(
        corpus, dp_size=layout.dp_size, **MODEL, vocab_size=VOCAB + 1, micro_batch_size=MICRO_BATCH,
        global_batch_size=GLOBAL_BATCH, train_iters=train_iters, lr=1e-4, min_lr=1e-5, lr_warmup_iters=0, zero_stage=0,
        eval_interval=10 * train_iters, tensor_model_parallel_size=layout.tp_size,
        pipeline_model_parallel_size=layout.pp_size, sequence_parallel=layout.sequence_parallel,
    )


def saved_activation_bytes(trainer: Trainer, text: torch.Tensor) -> int:
    """Bytes of the storages autograd keeps for backward over one micro-batch's forward, the
    parameters' not counted."""
    parameter_storages = {p.untyped_storage().data_ptr() for p in trainer.engine.module.parameters()}
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    batch = gpt_batch(text, trainer.tokenizer.eod, False, trainer.grid.device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        lm_loss(trainer.engine, batch)  # the graph is dropped on return: no backward, no step
    # whole storages: q, k and v are strided views of one projection's output, which stays alive whole
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(nbytes for pointer, nbytes in held.items() if pointer not in parameter_storages)


def rank_run(layout: Layout, corpus: str, warmup: int, steps: int) -> dict[str, torch.Tensor]:
    """One rank of one run: build the Trainer, warm up, time `steps` steps; step times and byte counts."""
    with open("/proc/self/clear_refs", "w") as clear_refs:  # peak RSS from here, not from import/spawn
        clear_refs.write("5")
    base_rss = proc_status_bytes("VmRSS")
    grid = build_parallel_grid(torch.device("cpu"), tp_size=layout.tp_size, pp_size=layout.pp_size)
    with contextlib.redirect_stdout(io.StringIO()):  # the run's log lines
        trainer = Trainer(layout_config(corpus, layout, warmup + steps), grid)
    engine, accumulation = trainer.engine, trainer.engine.gradient_accumulation_steps
    loader = trainer.loader(trainer.train_data, 0)
    batches = [next(loader) for _ in range((warmup + steps) * accumulation)]
    params = list(engine.module.parameters())
    grad_bytes, inner_step = [0], engine.optimizer.step

    def counting_step(*args: Any, **kwargs: Any) -> Any:  # the gradients alive when the optimizer reads them
        grad_bytes[0] = tensor_bytes([p.grad for p in params if p.grad is not None])
        return inner_step(*args, **kwargs)

    engine.optimizer.step = counting_step
    step_s = []
    for index in range(warmup + steps):
        micro_batches = iter(batches[index * accumulation:(index + 1) * accumulation])
        dist.barrier()  # every rank starts the step together: the time is the step, not the skew
        start = time.perf_counter()
        trainer.train_step(micro_batches)
        if index >= warmup:
            step_s.append(time.perf_counter() - start)
    state = [t for s in engine.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    split = [p for p in params if tensor_parallel_split(p) is not None]
    memory = {"param_bytes": tensor_bytes(params), "split_param_bytes": tensor_bytes(split),
              "whole_param_bytes": tensor_bytes([p for p in params if tensor_parallel_split(p) is None]),
              "grad_bytes": grad_bytes[0], "optim_bytes": tensor_bytes(state),
              "peak_rss_delta": proc_status_bytes("VmHWM") - base_rss}  # before the extra forward below
    memory["activation_bytes"] = saved_activation_bytes(trainer, batches[0]["text"])
    return {"step_s": torch.tensor(step_s, dtype=torch.float64),
            "memory": torch.tensor([memory[k] for k in MEMORY_KEYS], dtype=torch.int64)}


def interleaved(layouts: tuple[Layout, ...], rounds: int) -> list[tuple[int, Layout]]:
    """(round, layout) in the order they run: every layout once a round, reversed every other round."""
    return [(r, layout) for r in range(rounds) for layout in (layouts if r % 2 == 0 else layouts[::-1])]


def one_run(round_index: int, layout: Layout, corpus: str, warmup: int, steps: int) -> dict:
    """One layout in fresh processes: its step times (the slower rank's) and each rank's memory."""
    started = time.perf_counter()
    results = run_distributed(rank_run, RANKS, layout, corpus, warmup, steps)
    # a step ends at a collective both ranks join: take the slower rank per step
    step_s = torch.stack([r["step_s"] for r in results]).amax(0).tolist()
    run = {"layout": layout.name, "round": round_index, "step_s": step_s, "median_s": statistics.median(step_s),
           "wall_s": time.perf_counter() - started,
           "memory_per_rank": [dict(zip(MEMORY_KEYS, r["memory"].tolist())) for r in results]}
    print(f"round {round_index} {layout.name}: median step {1000 * run['median_s']:.0f} ms "
          f"({run['wall_s']:.0f} s with start-up)", flush=True)
    return run


def summarise(layouts: tuple[Layout, ...], runs: list[dict]) -> list[dict]:
    median_s = {(r["layout"], r["round"]): r["median_s"] for r in runs}
    rounds = sorted({r["round"] for r in runs})
    rows = []
    for layout in layouts:
        mine = [r for r in runs if r["layout"] == layout.name]
        memory = dict(mine[0]["memory_per_rank"][0])  # tensor byte counts are the same every run and rank
        memory["peak_rss_delta"] = int(statistics.median(rank["peak_rss_delta"] for r in mine for rank in r["memory_per_rank"]))
        ratios = [median_s[layout.name, r] / median_s[BASELINE.name, r] for r in rounds]
        step_ms = 1000 * statistics.median(r["median_s"] for r in mine)
        rows.append({"layout": layout.name, "tp": layout.tp_size, "pp": layout.pp_size, "dp": layout.dp_size,
                     "sequence_parallel": layout.sequence_parallel, "step_ms": step_ms,
                     "tokens_per_s": GLOBAL_BATCH * MODEL["seq_length"] / (step_ms / 1000),
                     "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                     "pipeline_bubble": pipeline_bubble(layout), **memory})
    base = rows[0]
    for row in rows:
        for key in ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes", "peak_rss_delta"):
            row[f"{key.removesuffix('_bytes')}_vs_dp"] = row[key] / base[key]
    return rows


def pipeline_row(corpus: str) -> Layout | None:
    """THE PLACE FOR PP=2: the layout to measure with the others, or None with one printed line.

    While the flags refuse --pipeline-model-parallel-size 2 (ConfigError), the row is skipped. Once
    they accept it, the row still waits for MEASURES_PIPELINE: rank_run first has to be made right
    for stages, namely the activation forward (a bare forward on one stage waits for the other
    stage's activations: run one micro-batch through the schedule instead) and the memory columns
    (each rank holds its stages' layers; the first and last stage the embedding and the head, so the
    table wants both ranks' bytes). Its row then also shows the bubble (`pipeline_bubble`)."""
    try:
        layout_config(corpus, PIPELINE, 1)
    except ConfigError as error:
        print(f"{PIPELINE.name}: row skipped, pipeline parallelism is not built yet ({error})")
        return None
    if not MEASURES_PIPELINE:
        print(f"{PIPELINE.name}: row skipped, the flags accept it but this benchmark does not measure pipeline "
              "stages yet (see pipeline_row)")
        return None
    return PIPELINE


def pipeline_bubble(layout: Layout) -> float | None:
    """(P-1)/(m+P-1), m the micro-batches of one step through the pipeline (per data-parallel rank)."""
    if layout.pp_size == 1:
        return None
    micro_batches = GLOBAL_BATCH // (MICRO_BATCH * layout.dp_size)
    return (layout.pp_size - 1) / (micro_batches + layout.pp_size - 1)


def print_table(rows: list[dict]) -> None:
    mib = 2**20
    print(f"\n{'layout':>8} {'step ms':>8} {'tok/s':>6} {'ratio':>6} {'range':>11} {'params':>7} {'split':>6} "
          f"{'whole':>6} {'grads':>6} {'optim':>6} {'activ.':>6} {'peak RSS':>8} {'bubble':>6}"
          f"   (MiB per rank; x = vs DP=2)")
    for r in rows:
        bubble = f"{r['pipeline_bubble']:6.3f}" if r["pipeline_bubble"] is not None else f"{'-':>6}"
        print(f"{r['layout']:>8} {r['step_ms']:8.0f} {r['tokens_per_s']:6.0f} {r['ratio']:6.3f} "
              f"{r['ratio_min']:5.3f}-{r['ratio_max']:.3f} {r['param_bytes'] / mib:7.1f} "
              f"{r['split_param_bytes'] / mib:6.1f} {r['whole_param_bytes'] / mib:6.2f} {r['grad_bytes'] / mib:6.1f} "
              f"{r['optim_bytes'] / mib:6.1f} {r['activation_bytes'] / mib:6.1f} {r['peak_rss_delta'] / mib:8.0f} {bubble}")
        if r["layout"] != BASELINE.name:
            print(f"{'':>8} {'':>8} {'':>6} {'':>6} {'':>11} {r['param_vs_dp']:6.2f}x {'':>6} {'':>6} "
                  f"{r['grad_vs_dp']:5.2f}x {r['optim_vs_dp']:5.2f}x {r['activation_vs_dp']:5.2f}x "
                  f"{r['peak_rss_delta_vs_dp']:7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=4, help="runs of each layout, alternating")
    parser.add_argument("--output", default="benchmarks/results/parallel.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        corpus = write_corpus(Path(folder), documents=400, vocab=VOCAB, length=600)
        pipeline = pipeline_row(corpus)
        layouts = LAYOUTS + ((pipeline,) if pipeline is not None else ())
        config = layout_config(corpus, BASELINE, 1)
        print(f"GPT {config.model.num_layers} layers, h {config.model.hidden_size}, {config.model.num_attention_heads} "
              f"heads, vocabulary {VOCAB + 1}, {RANKS} gloo ranks x 1 thread, global batch {GLOBAL_BATCH} = micro "
              f"batch {MICRO_BATCH} x {MODEL['seq_length']} tokens x (DP or accumulation) {RANKS}")
        runs = [one_run(r, layout, corpus, args.warmup, args.steps) for r, layout in interleaved(layouts, args.rounds)]
    rows = summarise(layouts, runs)
    print_table(rows)
    report = {"machine": platform.machine(), "cpu": cpu_name(), "ranks": RANKS, "threads_per_rank": 1,
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M %Z"),
              "model": {**MODEL, "vocab_size": VOCAB + 1, "parameters": rows[0]["param_bytes"] // 4},  # fp32, whole under DP "micro_batch": MICRO_BATCH, "global_batch": GLOBAL_BATCH,
              "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds,
              "pipeline": "measured" if pipeline is not None else "not built yet", "rows": rows, "runs": runs}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
