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

DeepSpeed is a benchmark-only dependency: without it, only our column is timed (with a note).
Prints a table and writes JSON (default benchmarks/results/moe_ep.json).

Legend: H hidden, F = 4H expert ffn hidden, E experts in the layer, K top-k, S tokens per rank.
"""

import argparse
import contextlib
import importlib.util
import itertools
import json
import math
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from benchmarks.moe_layer import cpu_name
from megatron.model.moe import MoEConfig, MoELayer
from megatron.parallel import build_parallel_grid

EP_SIZE = 2
CAPACITY_FACTOR, MIN_CAPACITY, AUX_COEFF = 1.0, 4, 0.01
PHASES = ("router", "dispatch", "experts", "return", "counts", "other")
# torch.distributed calls timed in the instrumented steps; DeepSpeed's comm calls these too
COLLECTIVES = ("all_to_all_single", "all_reduce")


class Case(NamedTuple):
    hidden: int
    experts: int
    topk: int
    tokens: int  # per rank
    drop: bool


DEFAULT_GRID = [
    Case(512, 8, 1, 4096, True), Case(512, 16, 1, 4096, True), Case(512, 64, 1, 4096, True),
    Case(512, 16, 2, 4096, True), Case(512, 64, 2, 4096, True), Case(1024, 16, 1, 4096, True),
    Case(512, 16, 1, 2048, True), Case(512, 16, 1, 16384, True),
    Case(512, 16, 1, 4096, False), Case(512, 16, 2, 4096, False),
]
QUICK_GRID = [Case(256, 8, 1, 1024, True), Case(256, 16, 2, 1024, False)]


# ---------------------------------------------------------------- the two layers, same weights

def config_of(case: Case, deterministic: bool) -> MoEConfig:
    return MoEConfig(topk=case.topk, train_capacity_factor=CAPACITY_FACTOR, min_capacity=MIN_CAPACITY,
                     drop_tokens=case.drop and not (deterministic and case.topk == 1),
                     use_rts=not deterministic, sample_second_expert=not deterministic, aux_loss_coeff=AUX_COEFF)


def build_ours(case: Case, config: MoEConfig, ep_group: dist.ProcessGroup) -> MoELayer:
    torch.manual_seed(0)  # the same router on both ranks; experts are drawn by global id
    h = case.hidden
    return MoELayer(h, 4 * h, case.experts, config, init_std=0.02, output_init_std=0.02 / math.sqrt(24),
                    ep_group=ep_group)


@torch.no_grad()
def build_deepspeed(deepspeed: Any, ours: MoELayer, case: Case, config: MoEConfig) -> nn.Module:
    """DeepSpeed's layer holding our router and this rank's experts: its local expert i on rank r is
    global expert r * E_l + i, as ours."""
    h = case.hidden
    expert = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
    layer = deepspeed.moe.layer.MoE(
        h, expert, case.experts, ep_size=EP_SIZE, k=case.topk, capacity_factor=CAPACITY_FACTOR,
        min_capacity=MIN_CAPACITY, drop_tokens=config.drop_tokens, use_rts=config.use_rts,
        top2_2nd_expert_sampling=config.sample_second_expert,
    )
    layer.set_deepspeed_parallelism()
    for _, theirs, mine in matching_tensors(ours, layer, grads=False):
        theirs.copy_(mine)
    return layer


def as_linear(w: torch.Tensor, in_features: int) -> torch.Tensor:
    """One expert's matrix as nn.Linear holds it ([out, in]), whichever way round ours stores it."""
    return w if w.shape[-1] == in_features else w.t()


def matching_tensors(
    ours: MoELayer, theirs: nn.Module, grads: bool
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, DeepSpeed's tensor, ours in DeepSpeed's layout) for the router and each local expert:
    the parameters, or with `grads` their gradients."""
    def of(param: torch.Tensor) -> torch.Tensor:
        return param.grad if grads else param

    yield "router", of(theirs.deepspeed_moe.gate.wg.weight), of(ours.router.weight)
    mine = ours.experts
    for i, (fc1, _, fc2) in enumerate(theirs.deepspeed_moe.experts.deepspeed_experts):
        yield f"expert {i} w1", of(fc1.weight), as_linear(of(mine.w1)[i], fc1.in_features)
        yield f"expert {i} b1", of(fc1.bias), of(mine.b1)[i]
        yield f"expert {i} w2", of(fc2.weight), as_linear(of(mine.w2)[i], fc2.in_features)
        yield f"expert {i} b2", of(fc2.bias), of(mine.b2)[i]


def inputs(case: Case, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's input [1, S, H] (it needs a gradient, as inside a model) and output gradient."""
    torch.manual_seed(1 + rank)
    x = torch.randn(1, case.tokens, case.hidden, requires_grad=True)
    return x, torch.randn(x.shape)


def forward_backward(impl: str, layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """loss = (out * grad).sum() + weighted aux loss, backward; returns the output."""
    if impl == "ours":
        out, router_loss = layer(x)
    else:
        out, l_aux, _ = layer(x)
        router_loss = AUX_COEFF * l_aux
    ((out * grad).sum() + router_loss).backward()
    return out.detach()


def step(impl: str, layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
    forward_backward(impl, layer, x, grad)
    layer.zero_grad(set_to_none=True)
    x.grad = None


def check_same(ours: MoELayer, theirs: nn.Module, case: Case, rank: int) -> None:
    """Outputs, input gradients and parameter gradients of the two layers agree on this rank."""
    x, grad = inputs(case, rank)
    out = forward_backward("ours", ours, x, grad)
    x_grad, x.grad = x.grad, None
    close = {"rtol": 1e-4, "atol": 1e-4}  # sums over thousands of rows in another order
    torch.testing.assert_close(forward_backward("deepspeed", theirs, x, grad), out, **close, msg="outputs")
    torch.testing.assert_close(x.grad, x_grad, **close, msg="input gradients")
    for name, got, want in matching_tensors(ours, theirs, grads=True):
        torch.testing.assert_close(got, want, **close, msg=lambda m, name=name: f"{name} gradients: {m}")


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
    router, experts = ((layer.router, layer.experts) if impl == "ours"
                       else (layer.deepspeed_moe.gate, layer.deepspeed_moe.experts))
    timeline = Timeline()
    dist.barrier()
    with instrumented(timeline, router, experts):
        start = time.perf_counter()
        step(impl, layer, x, grad)
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
    ours = build_ours(case, config_of(case, deterministic=False), ep_group)
    layers: dict[str, nn.Module] = {"ours": ours}
    if deepspeed is not None:
        check_config = config_of(case, deterministic=True)
        check_ours = build_ours(case, check_config, ep_group)
        check_same(check_ours, build_deepspeed(deepspeed, check_ours, case, check_config), case, rank)
        layers["deepspeed"] = build_deepspeed(deepspeed, ours, case, config_of(case, deterministic=False))
    x, grad = inputs(case, rank)
    for impl, layer in layers.items():
        for _ in range(opts.warmup):
            step(impl, layer, x, grad)
    times: dict[str, list[float]] = {impl: [] for impl in layers}
    for r in range(opts.rounds):
        for impl in (list(layers) if r % 2 == 0 else list(layers)[::-1]):  # alternate who goes first
            dist.barrier()
            start = time.perf_counter()
            for _ in range(opts.steps):
                step(impl, layers[impl], x, grad)
            elapsed = torch.tensor((time.perf_counter() - start) / opts.steps, dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when the slower rank is done
            times[impl].append(float(elapsed))
    row: dict[str, Any] = {**case._asdict(), "ours_ms": 1000 * statistics.median(times["ours"])}
    for impl, layer in layers.items():
        profiles = [profile_step(impl, layer, x, grad) for _ in range(opts.profile_steps)]
        row[f"{impl}_phases"] = {key: statistics.median(p[key] for p in profiles) for key in profiles[0]}
    if deepspeed is not None:
        ratios = [o / d for o, d in zip(times["ours"], times["deepspeed"])]
        row.update(deepspeed_ms=1000 * statistics.median(times["deepspeed"]),
                   ours_over_deepspeed=statistics.median(ratios), ours_over_deepspeed_range=[min(ratios), max(ratios)])
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
    if not want:
        return None
    import deepspeed  # noqa: PLC0415 (benchmark-only dependency, imported where it is used)
    import deepspeed.moe.layer  # noqa: F401, PLC0415
    deepspeed.init_distributed(dist_backend="gloo")  # wraps the process group that already exists
    return deepspeed


def rank_main(rank: int, port: int, grid: list[Case], opts: argparse.Namespace, with_deepspeed: bool, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(EP_SIZE))
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
    print(f"{'H':>5} {'E':>3} {'K':>2} {'S/rank':>6} {'drop':>5} {'ours ms':>8} {'DS ms':>8} {'ours/DS':>7}"
          f" {'range':>9} | {'router':>6} {'disp':>4} {'exprt':>5} {'ret':>4} {'cnts':>4} {'other':>5} {'wait':>4}"
          f" {'rows r0/r1':>11} | {'a2a':>4} {'exprt':>5} {'wait':>4}")
    for r in rows:
        p, q = r["ours_phases"], r.get("deepspeed_phases")
        timed = f"{'-':>8} {'-':>7} {'-':>9}"
        if q is not None:
            lo, hi = r["ours_over_deepspeed_range"]
            timed = f"{r['deepspeed_ms']:8.1f} {r['ours_over_deepspeed']:7.2f} {lo:4.2f}-{hi:4.2f}"
        ours = " ".join(f"{share(p, key):{width}.1f}" for key, width in (
            ("router", 6), ("dispatch", 4), ("experts", 5), ("return", 4), ("counts", 4), ("other", 5), ("wait", 4)))
        theirs = "" if q is None else (
            f" | {share(q, 'dispatch', 'return', 'counts'):4.1f} {share(q, 'experts'):5.1f} {share(q, 'wait'):4.1f}")
        print(f"{r['hidden']:5} {r['experts']:3} {r['topk']:2} {r['tokens']:6} {str(r['drop']):>5} {r['ours_ms']:8.1f}"
              f" {timed} | {ours} {'/'.join(str(int(n)) for n in p['rows']):>11}{theirs}")
    print("disp/ret: the all-to-all into/out of the experts, forward and backward; cnts: the counts exchange (time"
          " blocked on it); other: sort, permutes, combine, router backward; wait: time inside collectives until"
          " the other rank arrived (part of disp/ret/cnts); rows: rows the experts of rank 0/1 computed; DS a2a:"
          " all its collectives (it pads every expert to the capacity: equal rows on both ranks)")
    if not with_deepspeed:
        print("note: deepspeed is not importable here (pip install deepspeed==0.19.8): its column is skipped")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="*", help="grid of H (replaces the default grid)")
    parser.add_argument("--experts", type=int, nargs="*", help="grid of E")
    parser.add_argument("--topk", type=int, nargs="*", choices=[1, 2], help="grid of K")
    parser.add_argument("--tokens", type=int, nargs="*", help="grid of S per rank")
    parser.add_argument("--dropless", action="store_true", help="with a custom grid: drop_tokens=False")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1, help="steps per implementation per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile-steps", type=int, default=3, help="instrumented steps per implementation")
    parser.add_argument("--quick", action="store_true", help="two small cases (< 1 min)")
    parser.add_argument("--output", help="JSON path (default benchmarks/results/moe_ep[_quick].json)")
    return parser.parse_args()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    args = parse_args()
    if args.quick:
        grid = QUICK_GRID
    elif any(v is not None for v in (args.hidden, args.experts, args.topk, args.tokens)):
        grid = [Case(*c, not args.dropless) for c in itertools.product(
            args.hidden or [512], args.experts or [16], args.topk or [1], args.tokens or [4096])]
    else:
        grid = DEFAULT_GRID
    with_deepspeed = importlib.util.find_spec("deepspeed") is not None
    load_before = os.getloadavg()
    rows = run_ep(grid, args, with_deepspeed)
    print(f"EP={EP_SIZE}: fp32 forward+backward of one layer, {EP_SIZE} gloo processes x 1 thread, median of"
          f" {args.rounds} rounds x {args.steps} steps; DS = deepspeed.moe.layer.MoE(ep_size={EP_SIZE})")
    print_table(rows, with_deepspeed)
    load = os.getloadavg()
    during = max(r["load_average_1min"] for r in rows)
    output = Path(args.output or f"benchmarks/results/moe_ep{'_quick' if args.quick else ''}.json")
    report = {"machine": platform.machine(), "processor": cpu_name(), "torch": torch.__version__,
              "deepspeed": deepspeed_version() if with_deepspeed else None, "ep_size": EP_SIZE,
              "threads_per_rank": 1, "date": time.strftime("%Y-%m-%d %H:%M"),
              "load_average_before": load_before, "load_average_1min_max_during": during, "load_average_after": load,
              "args": vars(args), "rows": rows}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=1))
    print(f"load average (1 min; our two ranks add about 2): before {load_before[0]:.2f}, highest after a case"
          f" {during:.2f}, after {load[0]:.2f}; wrote {output}")


def deepspeed_version() -> str:
    from importlib.metadata import version  # noqa: PLC0415
    return version("deepspeed")


if __name__ == "__main__":
    main()
