"""Data against tensor and pipeline parallelism on the same 2 gloo ranks (one thread each): step
time and per-rank memory of one dense GPT under DP=2, TP=2, TP=2 with sequence parallelism and PP=2
(1F1B), each trained through the Trainer (megatron.training.loop) from the flags a user would give, ZeRO
stage 0, fp32.

Every layout of the main table trains the same global batch (micro batch 2 x 2 = 4 sequences a
step): DP=2 runs one micro-batch per rank, TP=2 and PP=2 run two micro-batches (gradient
accumulation; PP=2's go through the 1F1B schedule) through both ranks. So the step times compare the
same work, and the activations (per micro-batch) compare the same micro batch. A second pair trains
a 4x larger global batch (16 sequences: PP=2 runs m = 8 micro-batches through the pipeline, DP=2 four
per rank) so that the pipeline bubble's trend with m shows; its ratio is to DP=2 on that batch.
A third group trains the same model with an MoE layer of 4 experts (top-2, dropless) in place of
every other layer's dense MLP (Megatron-DeepSpeed's default interval): experts whole on both
ranks (MoE DP=2, the baseline), split by expert parallelism (MoE EP=2: each rank holds 2 experts)
and by expert tensor parallelism (MoE ETP=2: each rank holds half of every expert's hidden features;
the dense layers stay data-parallel).

Each (layout, round) is its own run_distributed call: fresh processes, so the RSS peaks do not mix.
Layouts alternate in rounds (the order reversed every other round) so machine drift hits them
alike. Step time: forward + backward + optimizer step of the whole global batch, the slower rank's,
median over the timed steps after warm-up; the ratio to DP=2 is the median of per-round ratios.
The batches are read from the corpus before timing starts.

Memory per rank (both ranks are kept: under PP=2 stage 0 holds the embedding, stage 1 the head and
the tied embedding's copy; the table's columns are the larger rank's), from the engine's tensors:
parameters (split over the tensor-parallel group, and held whole by every rank: norms, row-parallel
biases, position embeddings), gradients when the optimizer steps, optimizer state; the process's
peak RSS above its RSS before the Trainer was built (VmHWM after clear_refs); and activations,
counted over one more (untimed) training step through torch.autograd.graph.saved_tensors_hooks: the
storages autograd holds alive for backward (parameters and views of them not counted), those first
saved by the first micro-batch's forward (activations / micro-batch), their peak over the step
while backwards free them (1F1B keeps up to P - r micro-batches alive on stage r: measured here, not
assumed) and the most micro-batches with storages alive at once.

The pipeline bubble, measured: in the benchmark's processes only, StageLinks._exchange (every
point-to-point send and receive of the schedule, the wait for the neighbour included) and the
schedule (one_forward_one_backward as the Trainer calls it) are wrapped with timers. A stage is busy
for its time in the schedule less its time blocked in exchanges, and idle for the rest of the
pipeline's window (first stage in to last stage out); that fraction is set against the theoretical
(P-1)/(m+P-1) of equal stages and free transfers, and against what the same schedule gives for the
stages' measured costs (see pipeline_idle).

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
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

import torch
import torch.distributed as dist

import megatron.training.loop
from benchmarks.moe_layer import cpu_name, proc_status_bytes
from benchmarks.zero import tensor_bytes
from megatron.config.flags import PretrainConfig
from megatron.parallel import build_parallel_grid
from megatron.placement import tensor_parallel_split
from megatron.runtime.pipeline_schedule import StageLinks
from megatron.training.loop import Trainer
from tests.dist_utils import run_distributed
from tests.training_fixtures import tiny_config, write_corpus

RANKS, MICRO_BATCH = 2, 2
GLOBAL_BATCH = MICRO_BATCH * RANKS
# 8,191 token ids + the NullTokenizer's eod = 8,192: a multiple of 128 x TP, so no layout pads it
VOCAB = 8191
MODEL = dict(
    num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=256, hidden_dropout=0.0, attention_dropout=0.0
)
MEMORY_KEYS = (
    "param_bytes",
    "split_param_bytes",
    "whole_param_bytes",
    "grad_bytes",
    "optim_bytes",
    "activation_bytes",
    "activation_peak_bytes",
    "live_micro_batches",
    "peak_rss_delta",
)


class Layout(NamedTuple):
    name: str
    tp_size: int = 1
    pp_size: int = 1
    sequence_parallel: bool = False
    global_batch: int = GLOBAL_BATCH
    moe: bool = False
    ep_size: int = 1
    expert_tp_size: int = 1

    @property
    def dp_size(self) -> int:
        return RANKS // (self.tp_size * self.pp_size)

    @property
    def micro_batches(self) -> int:
        """m: the micro-batches one rank (one pipeline) runs a step."""
        return self.global_batch // (MICRO_BATCH * self.dp_size)

    @property
    def baseline(self) -> str:
        """The DP=2 layout of the same model and global batch, which this one's ratios are to."""
        return next(
            layout.name
            for layout in LAYOUTS + BUBBLE_LAYOUTS + MOE_LAYOUTS
            if layout.dp_size == RANKS
            and layout.global_batch == self.global_batch
            and layout.moe == self.moe
            and layout.ep_size == layout.expert_tp_size == 1
        )


BASELINE = Layout("DP=2")
LAYOUTS = (
    BASELINE,
    Layout("TP=2", tp_size=2),
    Layout("TP=2+SP", tp_size=2, sequence_parallel=True),
    Layout("PP=2", pp_size=2),
)
# the bubble's trend: the same pipeline over m = 8 micro-batches, against DP=2 on that global batch
BUBBLE_LAYOUTS = (
    Layout("DP=2 gb16", global_batch=4 * GLOBAL_BATCH),
    Layout("PP=2 gb16", pp_size=2, global_batch=4 * GLOBAL_BATCH),
)
MOE_LAYOUTS = (
    Layout("MoE DP=2", moe=True),
    Layout("MoE EP=2", moe=True, ep_size=2),
    Layout("MoE ETP=2", moe=True, expert_tp_size=2),
)
MOE = dict(num_experts=4, topk=2, disable_moe_token_dropping=True, disable_moe_top2_2nd_expert_sampling=True)


def layout_config(corpus: str, layout: Layout, train_iters: int) -> PretrainConfig:
    """The flags of one layout."""
    return tiny_config(
        corpus,
        dp_size=layout.dp_size,
        **MODEL,
        vocab_size=VOCAB + 1,
        micro_batch_size=MICRO_BATCH,
        global_batch_size=layout.global_batch,
        train_iters=train_iters,
        lr=1e-4,
        min_lr=1e-5,
        lr_warmup_iters=0,
        zero_stage=0,
        eval_interval=10 * train_iters,
        tensor_model_parallel_size=layout.tp_size,
        pipeline_model_parallel_size=layout.pp_size,
        sequence_parallel=layout.sequence_parallel,
        moe_expert_parallel_size=layout.ep_size,
        expert_tensor_parallel_size=layout.expert_tp_size,
        **(MOE if layout.moe else {}),
    )


class _Saved:
    """What the pack hook hands autograd: the saved tensor; a weakref.finalize on it tells when autograd drops it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedActivations:
    """Storages autograd holds for backward, followed as they come and go (saved_tensors_hooks):
    the bytes the first micro-batch's forward saves, the peak over everything run inside `counting`
    and the most micro-batches (forwards of `module`) with storages alive at once. Parameters' storages
    are not counted; q, k and v are strided views of one projection's output, which stays alive whole."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.parameter_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, holders, micro-batch]
        self.live_by_micro_batch: dict[int, int] = {}  # micro-batch -> its bytes alive
        self.first_micro_batch_bytes = self.live_bytes = self.peak_bytes = self.peak_micro_batches = 0
        self.micro_batch = -1

    def _pack(self, tensor: torch.Tensor) -> object:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer in self.parameter_storages:
            return tensor
        entry = self.live.get(pointer)
        if entry is None:
            entry = self.live[pointer] = [storage.nbytes(), 0, self.micro_batch]
            self.live_bytes += entry[0]
            self.live_by_micro_batch[self.micro_batch] = self.live_by_micro_batch.get(self.micro_batch, 0) + entry[0]
            if self.micro_batch == 0:
                self.first_micro_batch_bytes += entry[0]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.peak_micro_batches = max(self.peak_micro_batches, len(self.live_by_micro_batch))
        entry[1] += 1
        saved = _Saved(tensor)
        weakref.finalize(saved, self._release, pointer)
        return saved

    def _release(self, pointer: int) -> None:
        entry = self.live[pointer]
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[pointer]
            self.live_bytes -= entry[0]
            self.live_by_micro_batch[entry[2]] -= entry[0]
            if self.live_by_micro_batch[entry[2]] == 0:
                del self.live_by_micro_batch[entry[2]]

    @staticmethod
    def _unpack(saved: object) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _next_micro_batch(self, *_: Any) -> None:
        self.micro_batch += 1

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        hook = self.module.register_forward_pre_hook(self._next_micro_batch)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            hook.remove()


class PipelineTimers:
    """Seconds a stage spends blocked in point-to-point exchanges (StageLinks._exchange: posting, the
    wait for the neighbour, the transfer) and when it enters and leaves the schedule (perf_counter is
    CLOCK_MONOTONIC on Linux, one clock for every process of the machine), patched in this process
    only while `timing` is open."""

    def __init__(self) -> None:
        self.exchange_s = self.schedule_start = self.schedule_end = 0.0

    def _timed(self, fn: Callable[..., Any], on_return: Callable[[float, float], None]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                on_return(start, time.perf_counter())

        return timed

    def _exchanged(self, start: float, end: float) -> None:
        self.exchange_s += end - start

    def _scheduled(self, start: float, end: float) -> None:
        self.schedule_start, self.schedule_end = start, end

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        schedule = megatron.training.one_forward_one_backward  # the Trainer's reference, not the module's
        with (
            mock.patch.object(StageLinks, "_exchange", self._timed(StageLinks._exchange, self._exchanged)),
            mock.patch.object(
                megatron.training.loop, "one_forward_one_backward", self._timed(schedule, self._scheduled)
            ),
        ):
            yield

    def reset(self) -> None:
        self.exchange_s = self.schedule_start = self.schedule_end = 0.0


def rank_run(layout: Layout, corpus: str, warmup: int, steps: int) -> dict[str, torch.Tensor]:
    """One rank of one run: build the Trainer, warm up, time `steps` steps, count one more step's
    activations; step times, pipeline timers and byte counts."""
    with open("/proc/self/clear_refs", "w") as clear_refs:  # peak RSS from here, not from import/spawn
        clear_refs.write("5")
    base_rss = proc_status_bytes("VmRSS")
    grid = build_parallel_grid(
        torch.device("cpu"),
        tp_size=layout.tp_size,
        pp_size=layout.pp_size,
        ep_size=layout.ep_size,
        expert_tp_size=layout.expert_tp_size,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # the run's log lines
        trainer = Trainer(layout_config(corpus, layout, warmup + steps + 1), grid)
    engine, accumulation = trainer.engine, trainer.engine.gradient_accumulation_steps
    loader = trainer.loader(trainer.train_data, 0)
    batches = [next(loader) for _ in range((warmup + steps + 1) * accumulation)]
    params = list(engine.module.parameters())
    grad_bytes, inner_step = [0], engine.optimizer.step

    def counting_step(*args: Any, **kwargs: Any) -> Any:  # the gradients alive when the optimizer reads them
        grad_bytes[0] = tensor_bytes([p.grad for p in params if p.grad is not None])
        return inner_step(*args, **kwargs)

    def step_batches(index: int) -> Iterator[dict[str, torch.Tensor]]:
        return iter(batches[index * accumulation : (index + 1) * accumulation])

    engine.optimizer.step = counting_step
    timers = PipelineTimers()
    step_s, exchange_s, schedule_start, schedule_end = [], [], [], []
    with timers.timing():
        for index in range(warmup + steps):
            dist.barrier()  # every rank starts the step together: the time is the step, not the skew
            timers.reset()
            start = time.perf_counter()
            trainer.train_step(step_batches(index))
            if index >= warmup:
                step_s.append(time.perf_counter() - start)
                exchange_s.append(timers.exchange_s)
                schedule_start.append(timers.schedule_start)
                schedule_end.append(timers.schedule_end)
    peak_rss_delta = proc_status_bytes("VmHWM") - base_rss  # before the counted step below
    activations = SavedActivations(engine.module)
    with activations.counting():
        trainer.train_step(step_batches(warmup + steps))
    state = [t for s in engine.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    split = [p for p in params if tensor_parallel_split(p) is not None]
    memory = {
        "param_bytes": tensor_bytes(params),
        "split_param_bytes": tensor_bytes(split),
        "whole_param_bytes": tensor_bytes([p for p in params if tensor_parallel_split(p) is None]),
        "grad_bytes": grad_bytes[0],
        "optim_bytes": tensor_bytes(state),
        "activation_bytes": activations.first_micro_batch_bytes,
        "activation_peak_bytes": activations.peak_bytes,
        "live_micro_batches": activations.peak_micro_batches,
        "peak_rss_delta": peak_rss_delta,
    }
    return {
        "step_s": as_tensor(step_s),
        "exchange_s": as_tensor(exchange_s),
        "schedule_start": as_tensor(schedule_start),
        "schedule_end": as_tensor(schedule_end),
        "memory": torch.tensor([memory[k] for k in MEMORY_KEYS], dtype=torch.int64),
    }


def as_tensor(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def interleaved(layouts: tuple[Layout, ...], rounds: int) -> list[tuple[int, Layout]]:
    """(round, layout) in the order they run: every layout once a round, reversed every other round."""
    return [(r, layout) for r in range(rounds) for layout in (layouts if r % 2 == 0 else layouts[::-1])]


def run_length(layout: Layout, warmup: int, steps: int) -> tuple[int, int]:
    """(warm-up, timed) steps: a larger global batch runs fewer, so each run does about the same work."""
    scale = layout.global_batch // GLOBAL_BATCH
    return (warmup, steps) if scale == 1 else (max(1, warmup // scale), max(2, steps // scale))


def pipeline_idle(micro_batches: int, results: list[dict[str, torch.Tensor]]) -> list[dict]:
    """Each stage's idle time per step, medians over the steps (rank r is stage r: no TP or DP).

    The pipeline's window is the first stage's entry into the schedule to the last one's exit (the
    flush). A stage is busy for its time in the schedule less its time blocked in exchanges (its
    forwards and backwards) and idle for the rest of the window: `idle`, the fraction the theory's
    (P-1)/(m+P-1) is for equal stages. `expected` is the same schedule's idle for the stages' measured
    costs c_r (busy / m): the window is then (m-1) max(c) + sum(c) (fill and drain pass through every
    stage once, the steady state at the slowest one's pace), so idle_r = 1 - m c_r / window.
    `exchange_of_schedule` is the time blocked in exchanges over the stage's own time in the schedule
    (after its last send a stage leaves the schedule, and its wait for the others falls outside)."""
    start, end = (torch.stack([r[key] for r in results]) for key in ("schedule_start", "schedule_end"))
    window_s = end.amax(0) - start.amin(0)
    busy_s = torch.stack([r["schedule_end"] - r["schedule_start"] - r["exchange_s"] for r in results])
    cost_s = busy_s / micro_batches
    expected_window_s = (micro_batches - 1) * cost_s.amax(0) + cost_s.sum(0)
    return [
        {
            "idle": statistics.median((1 - busy_s[s] / window_s).tolist()),
            "expected": statistics.median((1 - micro_batches * cost_s[s] / expected_window_s).tolist()),
            "exchange_of_schedule": statistics.median(
                (r["exchange_s"] / (r["schedule_end"] - r["schedule_start"])).tolist()
            ),
            "busy_ms": 1000 * statistics.median(busy_s[s].tolist()),
            "exchange_ms": 1000 * statistics.median(r["exchange_s"].tolist()),
            "window_ms": 1000 * statistics.median(window_s.tolist()),
        }
        for s, r in enumerate(results)
    ]


def one_run(round_index: int, layout: Layout, corpus: str, warmup: int, steps: int) -> dict:
    """One layout in fresh processes: its step times (the slower rank's), each rank's memory and,
    under PP, each stage's time in the schedule and blocked in its exchanges."""
    started = time.perf_counter()
    results = run_distributed(rank_run, RANKS, layout, corpus, *run_length(layout, warmup, steps))
    # a step ends at a collective both ranks join: take the slower rank per step
    step_s = torch.stack([r["step_s"] for r in results]).amax(0).tolist()
    run = {
        "layout": layout.name,
        "round": round_index,
        "step_s": step_s,
        "median_s": statistics.median(step_s),
        "wall_s": time.perf_counter() - started,
        "memory_per_rank": [dict(zip(MEMORY_KEYS, r["memory"].tolist())) for r in results],
    }
    if layout.pp_size > 1:
        run["stages"] = pipeline_idle(layout.micro_batches, results)
    idle = "".join(f", stage {s} idle {stage['idle']:.3f}" for s, stage in enumerate(run.get("stages", [])))
    print(
        f"round {round_index} {layout.name}: median step {1000 * run['median_s']:.0f} ms{idle} "
        f"({run['wall_s']:.0f} s with start-up)",
        flush=True,
    )
    return run


def summarise(layouts: tuple[Layout, ...], runs: list[dict]) -> list[dict]:
    median_s = {(r["layout"], r["round"]): r["median_s"] for r in runs}
    rounds = sorted({r["round"] for r in runs})
    by_name = {layout.name: layout for layout in layouts}
    rows = []
    for layout in layouts:
        mine = [r for r in runs if r["layout"] == layout.name]
        # tensor byte counts are the same every run; the RSS peak is each rank's median over the runs
        per_rank = [dict(rank) for rank in mine[0]["memory_per_rank"]]
        for rank, memory in enumerate(per_rank):
            memory["peak_rss_delta"] = int(
                statistics.median(r["memory_per_rank"][rank]["peak_rss_delta"] for r in mine)
            )
        ratios = [median_s[layout.name, r] / median_s[layout.baseline, r] for r in rounds]
        step_ms = 1000 * statistics.median(r["median_s"] for r in mine)
        row = {
            "layout": layout.name,
            "tp": layout.tp_size,
            "pp": layout.pp_size,
            "dp": layout.dp_size,
            "moe": layout.moe,
            "ep": layout.ep_size,
            "expert_tp": layout.expert_tp_size,
            "sequence_parallel": layout.sequence_parallel,
            "global_batch": layout.global_batch,
            "micro_batches": layout.micro_batches,
            "baseline": layout.baseline,
            "step_ms": step_ms,
            "tokens_per_s": layout.global_batch * MODEL["seq_length"] / (step_ms / 1000),
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "pipeline_bubble": pipeline_bubble(layout),
            "memory_per_rank": per_rank,
            **{key: max(memory[key] for memory in per_rank) for key in MEMORY_KEYS},
        }
        if layout.pp_size > 1:
            row["stages"] = [
                {key: statistics.median(r["stages"][s][key] for r in mine) for key in mine[0]["stages"][s]}
                for s in range(layout.pp_size)
            ]  # medians over the runs of the runs' medians
            row["idle_min"] = [min(r["stages"][s]["idle"] for r in mine) for s in range(layout.pp_size)]
            row["idle_max"] = [max(r["stages"][s]["idle"] for r in mine) for s in range(layout.pp_size)]
            row["idle_mean"] = statistics.mean(stage["idle"] for stage in row["stages"])  # the pipeline's bubble
        rows.append(row)
    rows_by_name = {row["layout"]: row for row in rows}
    for row in rows:
        base = rows_by_name[by_name[row["layout"]].baseline]
        for key in (
            "param_bytes",
            "grad_bytes",
            "optim_bytes",
            "activation_bytes",
            "activation_peak_bytes",
            "peak_rss_delta",
        ):
            row[f"{key.removesuffix('_bytes')}_vs_dp"] = row[key] / base[key]
    return rows


def pipeline_bubble(layout: Layout) -> float | None:
    """(P-1)/(m+P-1), m the micro-batches of one step through the pipeline (per data-parallel rank)."""
    if layout.pp_size == 1:
        return None
    return (layout.pp_size - 1) / (layout.micro_batches + layout.pp_size - 1)


def print_table(rows: list[dict]) -> None:
    mib = 2**20
    print(
        f"\n{'layout':>10} {'m':>2} {'step ms':>8} {'tok/s':>6} {'ratio':>6} {'range':>11} {'params':>7} {'split':>6} "
        f"{'whole':>6} {'grads':>6} {'optim':>6} {'act/mb':>6} {'act pk':>6} {'live':>4} {'peak RSS':>8}"
        f"   (MiB per rank, the larger rank's; x = vs DP=2 of the same model and global batch; split: "
        f"tensor-parallel slices, the experts' under ETP)"
    )

    def memory_columns(m: dict) -> str:
        return (
            f"{m['param_bytes'] / mib:7.1f} {m['split_param_bytes'] / mib:6.1f} {m['whole_param_bytes'] / mib:6.2f} "
            f"{m['grad_bytes'] / mib:6.1f} {m['optim_bytes'] / mib:6.1f} {m['activation_bytes'] / mib:6.1f} "
            f"{m['activation_peak_bytes'] / mib:6.1f} {m['live_micro_batches']:4d} {m['peak_rss_delta'] / mib:8.0f}"
        )

    for r in rows:
        print(
            f"{r['layout']:>10} {r['micro_batches']:2d} {r['step_ms']:8.0f} {r['tokens_per_s']:6.0f} {r['ratio']:6.3f} "
            f"{r['ratio_min']:5.3f}-{r['ratio_max']:.3f} {memory_columns(r)}"
        )
        if r["layout"] != r["baseline"]:
            print(
                f"{'':>10} {'':>2} {'':>8} {'':>6} {'':>6} {'':>11} {r['param_vs_dp']:6.2f}x {'':>6} {'':>6} "
                f"{r['grad_vs_dp']:5.2f}x {r['optim_vs_dp']:5.2f}x {r['activation_vs_dp']:5.2f}x "
                f"{r['activation_peak_vs_dp']:5.2f}x {'':>4} {r['peak_rss_delta_vs_dp']:7.2f}x"
            )
        if r["pp"] > 1:
            for stage, memory in enumerate(r["memory_per_rank"]):
                print(f"{f'stage {stage}':>10} {'':>2} {'':>8} {'':>6} {'':>6} {'':>11} {memory_columns(memory)}")
    print(
        "\npipeline bubble: a stage's idle fraction of the pipeline's window (first entry into the 1F1B schedule to "
        "last exit; idle = not in its forwards and backwards), medians (range over runs); theory (P-1)/(m+P-1) for "
        "equal stages, 'expected' for the stages' measured costs; 'blocked' = time in point-to-point exchanges / "
        "the stage's own time in the schedule"
    )
    for r in rows:
        if r["pp"] > 1:
            print(
                f"{r['layout']:>10} m={r['micro_batches']}: theory {r['pipeline_bubble']:.3f}, mean of the stages "
                f"{r['idle_mean']:.3f}, window {r['stages'][0]['window_ms']:.0f} ms"
            )
            for s, stage in enumerate(r["stages"]):
                print(
                    f"{'':>10} stage {s}: idle {stage['idle']:.3f} ({r['idle_min'][s]:.3f}-{r['idle_max'][s]:.3f}), "
                    f"expected {stage['expected']:.3f}, busy {stage['busy_ms']:.0f} ms, blocked "
                    f"{stage['exchange_ms']:.0f} ms = {stage['exchange_of_schedule']:.3f} of its schedule"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--steps", type=int, default=6, help="timed steps per run (the 4x global batch a quarter, 2 at least)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="runs of each layout, alternating")
    parser.add_argument("--output", default="benchmarks/results/parallel.json")
    args = parser.parse_args()
    layouts = LAYOUTS + BUBBLE_LAYOUTS + MOE_LAYOUTS
    with tempfile.TemporaryDirectory() as folder:
        corpus = write_corpus(Path(folder), documents=400, vocab=VOCAB, length=600)
        config = layout_config(corpus, BASELINE, 1)
        print(
            f"GPT {config.model.num_layers} layers, h {config.model.hidden_size}, {config.model.num_attention_heads} "
            f"heads, vocabulary {VOCAB + 1}, {RANKS} gloo ranks x 1 thread, global batch {GLOBAL_BATCH} = micro "
            f"batch {MICRO_BATCH} x {MODEL['seq_length']} tokens x (DP or accumulation) {RANKS}; the bubble's "
            f"pair at global batch {BUBBLE_LAYOUTS[0].global_batch}; the MoE group with {MOE['num_experts']} "
            f"experts top-{MOE['topk']} dropless in every other layer"
        )
        runs = [one_run(r, layout, corpus, args.warmup, args.steps) for r, layout in interleaved(layouts, args.rounds)]
    rows = summarise(layouts, runs)
    print_table(rows)
    report = {
        "machine": platform.machine(),
        "cpu": cpu_name(),
        "ranks": RANKS,
        "threads_per_rank": 1,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "model": {**MODEL, "vocab_size": VOCAB + 1, "parameters": rows[0]["param_bytes"] // 4},  # fp32, whole under DP
        "micro_batch": MICRO_BATCH,
        "global_batch": GLOBAL_BATCH,
        "warmup": args.warmup,
        "steps": args.steps,
        "rounds": args.rounds,
        "rows": rows,
        "runs": runs,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
