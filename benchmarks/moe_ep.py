"""Expert parallelism, EP=2: forward+backward of one MoE layer split over two gloo processes (one
thread each), ours against DeepSpeed's `deepspeed.moe.layer.MoE(ep_size=2)` with the same router and
expert weights and the same inputs on each rank.

Before timing, each case checks that both layers compute the same outputs and gradients (routing
made deterministic for the check: no random token selection, no sampled second expert, top-1
without dropping, since DeepSpeed breaks capacity ties in top-1 in no fixed token order). The two
then run interleaved in rounds (training-mode routing, as users run it); a round's time is the
slower rank's, and the ratio ours/DeepSpeed is the median of the per-round ratios.

A few further steps of each are instrumented, to show where the step goes: the router's forward,
the dispatch all-to-all (forward and its backward), the experts (forward and backward), the return
all-to-all, the rest (sorting, permutes, combine, router backward), and how long each rank waits
inside the collectives for the other one to arrive: collective entry times are compared across
the ranks (one monotonic clock per machine). For those steps only, torch.distributed's collectives
are wrapped with timers (DeepSpeed's comm layer calls them too) and module hooks time the router
and the experts. DeepSpeed pads every expert to the capacity, so its
ranks exchange and compute equal row counts; ours sends only the routed rows, so the rank whose
experts got more tokens works longer and the other one waits.

Run as benchmarks/moe_layer.py's EP mode: `python -m benchmarks.moe_layer --ep-size 2` (its grid flags and
--quick apply; without them, the grid below). DeepSpeed is a benchmark-only dependency: without it,
only our column is timed (with a note). Prints a table and writes JSON (default
benchmarks/results/moe_ep.json).

Legend: H hidden, F = 4H expert ffn hidden, E experts in the layer, K top-k, S tokens per rank.
"""

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from benchmarks.moe_layer import (
    Case,
    assert_same,
    build_deepspeed,
    build_ours,
    cpu_name,
    deepspeed_version,
    moe_config,
    start_deepspeed,
    step,
)
from megatron.parallel import build_parallel_grid, free_port

EP_SIZE = 2
PHASES = ("router", "dispatch", "experts", "return", "counts", "other")
# torch.distributed calls timed in the instrumented steps; DeepSpeed's comm calls these too
COLLECTIVES = ("all_to_all_single", "all_reduce")


DEFAULT_GRID = [
    Case(512, 8, 1, 4096, True),
    Case(512, 16, 1, 4096, True),
    Case(512, 64, 1, 4096, True),
    Case(512, 16, 2, 4096, True),
    Case(512, 64, 2, 4096, True),
    Case(1024, 16, 1, 4096, True),
    Case(512, 16, 1, 2048, True),
    Case(512, 16, 1, 16384, True),
    Case(512, 16, 1, 4096, False),
    Case(512, 16, 2, 4096, False),
]
QUICK_GRID = [Case(256, 8, 1, 1024, True), Case(256, 16, 2, 1024, False)]


# ---------------------------------------------------------------- inputs


def inputs(case: Case, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's input [1, S, H] (it needs a gradient, as inside a model) and output gradient."""
    torch.manual_seed(1 + rank)
    x = torch.randn(1, case.tokens, case.hidden, requires_grad=True)
    return x, torch.randn(x.shape)


# ---------------------------------------------------------------- instrumented steps


class Timeline:
    """Phase times of one instrumented step on this rank: module hooks time the router's forward
    and the experts' forward and backward; wrapped torch.distributed calls time the collectives,
    labelled `counts` for integer tensors, else by whether the experts have run yet (dispatch
    before, return after, in both passes). An asynchronous collective counts the time its caller
    blocks in `wait()`, all of it waiting."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, float, float]] = []  # (phase, start, end)
        self.blocking: list[tuple[float, float]] = []  # (entry, seconds inside) per blocking collective
        self.async_wait = 0.0
        self.rows = 0
        self._after_experts = False
        self._open: dict[str, float] = {}

    def start(self, key: str) -> None:
        self._open[key] = time.perf_counter()

    def stop(self, key: str, phase: str) -> None:  # returns None: a forward hook's result replaces the output
        self.spans.append((phase, self._open.pop(key), time.perf_counter()))

    def last_seconds(self) -> float:
        _, start, end = self.spans[-1]
        return end - start

    def hook(self, router: nn.Module, experts: nn.Module) -> list[Any]:
        def experts_in(_module: nn.Module, args: tuple) -> None:
            self.rows += args[0].shape[-2] * math.prod(args[0].shape[:-2])
            args[0].register_hook(lambda _g: self._experts_backward_done())
            self.start("experts")

        def experts_out(_module: nn.Module, _args: tuple, out: torch.Tensor) -> None:
            self.stop("experts", "experts")
            self._after_experts = True
            out.register_hook(lambda _g: self.start("experts_backward"))

        return [
            router.register_forward_pre_hook(lambda *_: self.start("router")),
            router.register_forward_hook(lambda *_: self.stop("router", "router")),
            experts.register_forward_pre_hook(experts_in),
            experts.register_forward_hook(experts_out),
        ]

    def _experts_backward_done(self) -> None:
        self.stop("experts_backward", "experts")
        self._after_experts = False

    def wrap(self, collective: Callable) -> Callable:
        def timed(*args, **kwargs):
            tensor = next((kwargs[k] for k in ("output", "tensor", "output_tensor") if k in kwargs), None)
            tensor = args[0] if tensor is None else tensor
            phase = "counts" if not tensor.is_floating_point() else "return" if self._after_experts else "dispatch"
            entry = time.perf_counter()
            self.start("collective")
            result = collective(*args, **kwargs)
            self.stop("collective", phase)
            if kwargs.get("async_op"):
                return _TimedWork(result, self, phase)
            self.blocking.append((entry, self.last_seconds()))
            return result

        return timed


class _TimedWork:
    """An asynchronous collective's handle whose `wait()` is timed."""

    def __init__(self, work: Any, timeline: Timeline, phase: str) -> None:
        self.work, self.timeline, self.phase = work, timeline, phase

    def wait(self) -> bool:
        self.timeline.start("wait")
        done = self.work.wait()
        self.timeline.stop("wait", self.phase)
        self.timeline.async_wait += self.timeline.last_seconds()
        return done


@contextlib.contextmanager
def instrumented(timeline: Timeline, router: nn.Module, experts: nn.Module) -> Iterator[None]:
    handles = timeline.hook(router, experts)
    originals = {name: getattr(dist, name) for name in COLLECTIVES}
    for name, fn in originals.items():
        setattr(dist, name, timeline.wrap(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        for handle in handles:
            handle.remove()


def profile_step(impl: str, layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> dict[str, float]:
    """Seconds per phase of one step on this rank, with `wait` (inside collectives, until the
    other rank arrived) and `step`, plus `rows` the experts computed here."""
    router, experts = (
        (layer.router, layer.experts) if impl == "ours" else (layer.deepspeed_moe.gate, layer.deepspeed_moe.experts)
    )
    timeline = Timeline()
    dist.barrier()
    with instrumented(timeline, router, experts):
        start = time.perf_counter()
        step(layer, x, grad)
        total = time.perf_counter() - start
    calls = torch.tensor(timeline.blocking, dtype=torch.float64).view(-1, 2)  # (entry, seconds inside)
    every_rank = [torch.empty_like(calls) for _ in range(dist.get_world_size())]
    dist.all_gather(every_rank, calls)
    last_entry = torch.stack(every_rank)[:, :, 0].max(0).values
    phases = dict.fromkeys(PHASES, 0.0)
    for phase, begin, end in timeline.spans:
        phases[phase] += end - begin
    phases["other"] = total - sum(phases.values())
    # inside a collective, a rank waits until the last rank has arrived (at most the time inside it)
    waits = torch.minimum(last_entry - calls[:, 0], calls[:, 1]).clamp(min=0)
    phases["wait"] = float(waits.sum()) + timeline.async_wait
    return {**phases, "step": total, "rows": float(timeline.rows)}


# ---------------------------------------------------------------- one case on one rank


def time_case(case: Case, rank: int, ep_group: dist.ProcessGroup, deepspeed: Any, opts: argparse.Namespace) -> dict:
    ours = build_ours(case, moe_config(case, deterministic=False), ep_group)
    layers: dict[str, nn.Module] = {"ours": ours}
    if deepspeed is not None:
        check_config = moe_config(case, deterministic=True)
        check_ours = build_ours(case, check_config, ep_group)
        assert_same(
            check_ours, build_deepspeed(check_ours, check_config, EP_SIZE), *inputs(case, rank), f"{case} rank {rank}"
        )
        layers["deepspeed"] = build_deepspeed(ours, moe_config(case, deterministic=False), EP_SIZE)
    x, grad = inputs(case, rank)
    for layer in layers.values():
        for _ in range(opts.warmup):
            step(layer, x, grad)
    times: dict[str, list[float]] = {impl: [] for impl in layers}
    for r in range(opts.rounds):
        for impl in list(layers) if r % 2 == 0 else list(layers)[::-1]:  # alternate who goes first
            dist.barrier()
            start = time.perf_counter()
            for _ in range(opts.steps):
                step(layers[impl], x, grad)
            elapsed = torch.tensor((time.perf_counter() - start) / opts.steps, dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when the slower rank is done
            times[impl].append(float(elapsed))
    row: dict[str, Any] = {**case._asdict(), "ours_ms": 1000 * statistics.median(times["ours"])}
    for impl, layer in layers.items():
        profiles = [profile_step(impl, layer, x, grad) for _ in range(opts.profile_steps)]
        row[f"{impl}_phases"] = {key: statistics.median(p[key] for p in profiles) for key in profiles[0]}
    if deepspeed is not None:
        ratios = [o / d for o, d in zip(times["ours"], times["deepspeed"])]
        row.update(
            deepspeed_ms=1000 * statistics.median(times["deepspeed"]),
            ours_over_deepspeed=statistics.median(ratios),
            ours_over_deepspeed_range=[min(ratios), max(ratios)],
        )
    return row


def gather_rows(row: dict) -> dict:
    """Per-rank phase times as lists [rank 0, rank 1] in rank 0's row."""
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    merged = dict(rows[0])
    for key in (k for k in merged if k.endswith("_phases")):
        merged[key] = {phase: [r[key][phase] for r in rows] for phase in merged[key]}
    return merged


def load_deepspeed(want: bool) -> Any:
    """DeepSpeed over the process group that already exists, or None."""
    return start_deepspeed() if want else None


def rank_main(rank: int, port: int, grid: list[Case], opts: argparse.Namespace, with_deepspeed: bool, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(EP_SIZE)
    )
    torch.set_num_threads(1)
    grid_of_ranks = build_parallel_grid(torch.device("cpu"), ep_size=EP_SIZE)
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's log lines stay out of the table
        deepspeed = load_deepspeed(with_deepspeed)
        rows = []
        for n, case in enumerate(grid, 1):
            row = time_case(case, rank, grid_of_ranks.ep_group, deepspeed, opts)
            rows.append(gather_rows({**row, "load_average_1min": os.getloadavg()[0]}))
            if rank == 0:
                print(f"timed {n}/{len(grid)}: {case}", file=sys.stderr, flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def run_ep(grid: list[Case], opts: argparse.Namespace, with_deepspeed: bool) -> list[dict]:
    """Every case of `grid` in two fresh gloo processes; rank 0's rows with both ranks' phases.
    `opts` needs rounds, steps, warmup and profile_steps."""
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/rows.json"
        mp.spawn(rank_main, args=(free_port(), grid, opts, with_deepspeed, out), nprocs=EP_SIZE, join=True)
        return json.loads(Path(out).read_text())


# ---------------------------------------------------------------- report


def share(phases: dict[str, list[float]], *keys: str) -> float:
    """Percent of the step in `keys`, averaged over the ranks."""
    return 100 * statistics.fmean(sum(phases[k][r] for k in keys) / phases["step"][r] for r in range(EP_SIZE))


def print_table(rows: list[dict], with_deepspeed: bool) -> None:
    print(f"{'':63}|{'ours: % of the step':^47}|{'DS: % of the step':^18}")
    print(
        f"{'H':>5} {'E':>3} {'K':>2} {'S/rank':>6} {'drop':>5} {'ours ms':>8} {'DS ms':>8} {'ours/DS':>7}"
        f" {'range':>9} | {'router':>6} {'disp':>4} {'exprt':>5} {'ret':>4} {'cnts':>4} {'other':>5} {'wait':>4}"
        f" {'rows r0/r1':>11} | {'a2a':>4} {'exprt':>5} {'wait':>4}"
    )
    for r in rows:
        p, q = r["ours_phases"], r.get("deepspeed_phases")
        timed = f"{'-':>8} {'-':>7} {'-':>9}"
        if q is not None:
            lo, hi = r["ours_over_deepspeed_range"]
            timed = f"{r['deepspeed_ms']:8.1f} {r['ours_over_deepspeed']:7.2f} {lo:4.2f}-{hi:4.2f}"
        ours = " ".join(
            f"{share(p, key):{width}.1f}"
            for key, width in (
                ("router", 6),
                ("dispatch", 4),
                ("experts", 5),
                ("return", 4),
                ("counts", 4),
                ("other", 5),
                ("wait", 4),
            )
        )
        theirs = (
            ""
            if q is None
            else (
                f" | {share(q, 'dispatch', 'return', 'counts'):4.1f} {share(q, 'experts'):5.1f} {share(q, 'wait'):4.1f}"
            )
        )
        print(
            f"{r['hidden']:5} {r['experts']:3} {r['topk']:2} {r['tokens']:6} {r['drop']!s:>5} {r['ours_ms']:8.1f}"
            f" {timed} | {ours} {'/'.join(str(int(n)) for n in p['rows']):>11}{theirs}"
        )
    print(
        "disp/ret: the all-to-all into/out of the experts, forward and backward; cnts: the counts exchange (time"
        " blocked on it); other: sort, permutes, combine, router backward; wait: time inside collectives until"
        " the other rank arrived (part of disp/ret/cnts); rows: rows the experts of rank 0/1 computed; DS a2a:"
        " all its collectives (it pads every expert to the capacity: equal rows on both ranks)"
    )
    if not with_deepspeed:
        print("note: deepspeed is not importable here (pip install deepspeed==0.19.8): its column is skipped")


def run_and_report(grid: list[Case], args: argparse.Namespace, with_deepspeed: bool, output: Path) -> None:
    """benchmarks/moe_layer.py's EP=2 mode: times `grid`, prints the table, writes the JSON report."""
    load_before = os.getloadavg()
    rows = run_ep(grid, args, with_deepspeed)
    print(
        f"EP={EP_SIZE}: fp32 forward+backward of one layer, {EP_SIZE} gloo processes x 1 thread, median of"
        f" {args.rounds} rounds x {args.steps} steps; DS = deepspeed.moe.layer.MoE(ep_size={EP_SIZE})"
    )
    print_table(rows, with_deepspeed)
    load = os.getloadavg()
    during = max(r["load_average_1min"] for r in rows)
    report = {
        "machine": platform.machine(),
        "processor": cpu_name(),
        "torch": torch.__version__,
        "deepspeed": deepspeed_version() if with_deepspeed else None,
        "ep_size": EP_SIZE,
        "threads_per_rank": 1,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_average_before": load_before,
        "load_average_1min_max_during": during,
        "load_average_after": load,
        "args": vars(args),
        "rows": rows,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=1))
    print(
        f"load average (1 min; our two ranks add about 2): before {load_before[0]:.2f}, highest after a case"
        f" {during:.2f}, after {load[0]:.2f}; wrote {output}"
    )
