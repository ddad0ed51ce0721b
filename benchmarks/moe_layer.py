"""Forward+backward time of one MoE layer (fp32) against (a) a dense MLP of equal active FLOPs per
token (H -> k*4H -> H) and (b) a GShard/DeepSpeed-style one-hot dispatch written here: top-k
gating that builds [S, E, C] combine weights and dispatch mask, einsum dispatch, batched experts
over stacked weights, einsum combine. All three compute loss = (out * fixed_grad).sum() + router loss.

The three run interleaved in rounds so machine drift hits them alike; each ratio is the median of
the per-round ratios. Targets: ours/(a) <= 1.25; (b)/ours >= 2 from E = 16 up. Peak memory of
one step is measured per token count in a fresh subprocess (peak RSS minus RSS after setup, Linux
/proc), since CPU torch has no allocator statistics. Prints tables and writes JSON (default benchmarks/results/moe_layer.json).

Legend: S tokens, H hidden, F = 4H expert ffn hidden, E experts, K top-k, C capacity per expert.
"""

import argparse
import itertools
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.moe import MoEConfig, MoELayer
from megatron.model.moe.router import gumbel_like

IMPLS = ("ours", "dense", "onehot")
CAPACITY_FACTOR, MIN_CAPACITY, AUX_COEFF = 1.0, 4, 0.01


class Case(NamedTuple):
    hidden: int
    experts: int
    topk: int
    tokens: int


DEFAULT_GRID = (
    [Case(512, e, k, 4096) for k in (1, 2) for e in (8, 16, 32, 64)]
    + [Case(1024, e, 1, 4096) for e in (16, 64)]
    + [Case(512, 16, 1, s) for s in (2048, 8192, 16384)]
)
DEFAULT_MEMORY = [Case(512, 16, 1, s) for s in (2048, 4096, 8192, 16384)]
QUICK_GRID = [Case(256, 8, 1, 1024), Case(256, 16, 2, 1024)]
QUICK_MEMORY = [Case(256, 16, 1, s) for s in (1024, 2048, 4096)]


def capacity(case: Case) -> int:
    """DeepSpeed's rule, as our router uses it: ceil(K * S / E * cf), at least min_capacity."""
    return max(math.ceil(case.topk * case.tokens / case.experts * CAPACITY_FACTOR), MIN_CAPACITY)


def onehot_bytes(case: Case) -> int:
    """Estimated peak of (b)'s [S, E, C] tensors: 3 fp32 ones (combine weights, float dispatch mask,
    combine-weight gradient). Measured here at H=512, E=16, 8192 tokens: about 2.4 (top-1), 3.1 (top-2)."""
    return 3 * case.tokens * case.experts * capacity(case) * 4


class OneHotMoE(nn.Module):
    """(b): the dense one-hot dispatch of GShard / DeepSpeed's sharded_moe, with RTS for top-1 and
    Gumbel-sampled second choice for top-2, as our layer does in training."""

    def __init__(self, hidden: int, ffn: int, experts: int, topk: int) -> None:
        super().__init__()
        self.topk = topk
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.w1_EHF = nn.Parameter(torch.randn(experts, hidden, ffn) * 0.02)
        self.b1_EF = nn.Parameter(torch.zeros(experts, ffn))
        self.w2_EFH = nn.Parameter(torch.randn(experts, ffn, hidden) * 0.02)
        self.b2_EH = nn.Parameter(torch.zeros(experts, hidden))

    def gating(self, logits_SE: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the aux loss and combine weights [S, E, C]; dispatch mask = combine != 0."""
        gates_SE = F.softmax(logits_SE, dim=1)
        num_experts = gates_SE.shape[1]
        first_SE = F.one_hot(gates_SE.argmax(1), num_experts)
        l_aux = num_experts * (gates_SE.mean(0) * first_SE.float().mean(0)).sum()
        if self.topk == 1:
            # RTS: each expert keeps the `cap` of its tokens with the highest random priority
            keep_CE = (first_SE * torch.rand_like(gates_SE)).topk(min(cap, len(gates_SE)), dim=0).indices
            mask_SE = first_SE * torch.zeros_like(first_SE).scatter_(0, keep_CE, 1)
            slot_S = ((torch.cumsum(mask_SE, 0) - 1) * mask_SE).sum(1)
            return l_aux, torch.einsum("se,sc->sec", gates_SE * mask_SE, F.one_hot(slot_S, cap).float())
        noisy_SE = (logits_SE + gumbel_like(logits_SE)).masked_fill(first_SE.bool(), float("-inf"))
        second_SE = F.one_hot(noisy_SE.argmax(1), num_experts)
        slot1_SE = torch.cumsum(first_SE, 0) - 1  # first choices take slots before any second choice
        slot2_SE = torch.cumsum(second_SE, 0) - 1 + first_SE.sum(0)
        first_SE, second_SE = first_SE * (slot1_SE < cap), second_SE * (slot2_SE < cap)
        gate1_S, gate2_S = (gates_SE * first_SE).sum(1), (gates_SE * second_SE).sum(1)
        denom_S = (gate1_S + gate2_S).clamp(min=torch.finfo(gates_SE.dtype).eps)
        combine_SEC = torch.einsum("se,sc->sec", (gate1_S / denom_S)[:, None] * first_SE,
                                   F.one_hot((slot1_SE * first_SE).sum(1), cap).float())
        return l_aux, combine_SEC + torch.einsum("se,sc->sec", (gate2_S / denom_S)[:, None] * second_SE,
                                                 F.one_hot((slot2_SE * second_SE).sum(1), cap).float())

    def forward(self, x_BSH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_SH = x_BSH.reshape(-1, x_BSH.shape[-1])
        cap = capacity(Case(x_SH.shape[1], self.b1_EF.shape[0], self.topk, x_SH.shape[0]))
        l_aux, combine_SEC = self.gating(self.gate(x_SH), cap)
        dispatched_ECH = torch.einsum("sec,sh->ech", combine_SEC.detach().ne(0).to(x_SH.dtype), x_SH)
        hidden_ECF = F.gelu(torch.bmm(dispatched_ECH, self.w1_EHF) + self.b1_EF[:, None])
        y_ECH = torch.bmm(hidden_ECF, self.w2_EFH) + self.b2_EH[:, None]
        return torch.einsum("sec,ech->sh", combine_SEC, y_ECH).view_as(x_BSH), AUX_COEFF * l_aux


class DenseMLP(nn.Module):
    """(a): H -> K*4H -> H, the FLOPs per token of the MoE layer's K active experts."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))

    def forward(self, x_BSH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mlp(x_BSH), x_BSH.new_zeros(())


def build(impl: str, case: Case) -> nn.Module:
    torch.manual_seed(0)  # same weights for every run of a case
    h, ffn = case.hidden, 4 * case.hidden
    if impl == "ours":
        config = MoEConfig(topk=case.topk, train_capacity_factor=CAPACITY_FACTOR, min_capacity=MIN_CAPACITY,
                           drop_tokens=True, use_rts=True, aux_loss_coeff=AUX_COEFF)
        return MoELayer(h, ffn, case.experts, config, init_std=0.02, output_init_std=0.02 / math.sqrt(24))
    if impl == "dense":
        return DenseMLP(h, case.topk * ffn)
    return OneHotMoE(h, ffn, case.experts, case.topk)


def inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Input [1, S, H] that needs a gradient, as inside a model, and a fixed output gradient."""
    torch.manual_seed(1)
    x = torch.randn(1, case.tokens, case.hidden, requires_grad=True)
    return x, torch.randn(x.shape)


def step(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
    out, router_loss = model(x)
    ((out * grad).sum() + router_loss).backward()
    model.zero_grad(set_to_none=True)
    x.grad = None


def time_case(case: Case, rounds: int, steps: int, warmup: int, cap_bytes: int) -> dict:
    impls = [i for i in IMPLS if i != "onehot" or onehot_bytes(case) <= cap_bytes]
    models, (x, grad) = {i: build(i, case) for i in impls}, inputs(case)
    for impl in impls:  # warm-up: kernels, allocator, the grouped-GEMM probe
        for _ in range(warmup):
            step(models[impl], x, grad)
    times: dict[str, list[float]] = {i: [] for i in impls}
    for _ in range(rounds):
        for impl in impls:
            start = time.perf_counter()
            for _ in range(steps):
                step(models[impl], x, grad)
            times[impl].append((time.perf_counter() - start) / steps)
    row = {**case._asdict(), "capacity": capacity(case), "onehot_est_bytes": onehot_bytes(case)}
    row.update({f"{i}_ms": 1000 * statistics.median(times[i]) for i in impls})
    ratios = [o / d for o, d in zip(times["ours"], times["dense"])]
    row.update(ours_over_dense=statistics.median(ratios), ours_over_dense_range=[min(ratios), max(ratios)])
    if "onehot" in impls:
        speedups = [b / o for b, o in zip(times["onehot"], times["ours"])]
        row.update(onehot_over_ours=statistics.median(speedups),
                   onehot_over_ours_range=[min(speedups), max(speedups)])
    return row


def proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


def memory_child(impl: str, case: Case) -> None:
    """Runs in a fresh process: setup and a tiny warm-up step (libraries, kernels, probes), then one
    full step; prints its peak RSS above the RSS before it. Not ru_maxrss: Linux carries the parent's
    RSS at fork into it across exec. Writing 5 to clear_refs resets this process's VmHWM instead."""
    model, (x, grad) = build(impl, case), inputs(case)
    step(model, *inputs(case._replace(tokens=64)))
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    base = proc_status_bytes("VmRSS")
    step(model, x, grad)
    print(json.dumps({"extra_bytes": proc_status_bytes("VmHWM") - base}))


def measure_memory(case: Case, cap_bytes: int) -> dict:
    row = {**case._asdict(), "capacity": capacity(case), "onehot_skipped": onehot_bytes(case) > cap_bytes}
    for impl in ("ours", "onehot"):
        if impl == "onehot" and row["onehot_skipped"]:
            continue
        cmd = [sys.executable, "-m", "benchmarks.moe_layer", "--memory-child", impl, *map(str, case)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:  # e.g. killed for memory: say so and keep the other rows
            print(f"memory step of {impl} for {case} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        row[f"{impl}_extra_bytes"] = json.loads(done.stdout.strip().splitlines()[-1])["extra_bytes"]
    return row


def ratio_cell(value: float, ok: bool | None) -> str:
    return f"{value:6.2f} {'  - ' if ok is None else 'PASS' if ok else 'FAIL'}"


def print_timing(rows: list[dict]) -> None:
    print(f"{'H':>5} {'E':>3} {'K':>2} {'tokens':>6} {'C':>5} {'ours ms':>9} {'(a) ms':>9} {'(b) ms':>18}"
          f" {'ours/(a)<=1.25':>15} {'(b)/ours>=2':>13}")
    for r in rows:
        onehot, speedup = f"{'skipped: > cap':>18}", "-"
        if "onehot_ms" in r:  # the speedup target applies from 16 experts up
            onehot = f"{r['onehot_ms']:18.1f}"
            speedup = ratio_cell(r["onehot_over_ours"], r["onehot_over_ours"] >= 2 if r["experts"] >= 16 else None)
        ratio = ratio_cell(r["ours_over_dense"], r["ours_over_dense"] <= 1.25)
        print(f"{r['hidden']:5} {r['experts']:3} {r['topk']:2} {r['tokens']:6} {r['capacity']:5}"
              f" {r['ours_ms']:9.1f} {r['dense_ms']:9.1f} {onehot} {ratio:>15} {speedup:>13}")


def print_memory(rows: list[dict]) -> None:
    """Ours should add about a constant number of bytes per token; (b) a constant per S*E*C element."""
    r0 = rows[0]
    print(f"\npeak extra memory of one forward+backward (H={r0['hidden']} E={r0['experts']} K={r0['topk']})")
    print(f"{'tokens':>6} {'C':>5} {'S*E*C':>11} {'ours MiB':>9} {'ours B/token':>13} {'(b) MiB':>15}"
          f" {'(b) B/token':>12} {'((b)-ours) B/(S*E*C)':>21}")
    rows = [r for r in rows if "ours_extra_bytes" in r]
    for r in rows:
        ours, sec = r["ours_extra_bytes"], r["tokens"] * r["experts"] * r["capacity"]
        if "onehot_extra_bytes" in r:  # the difference to ours leaves (b)'s [S, E, C] tensors
            b = r["onehot_extra_bytes"]
            onehot = f"{b / 2**20:15.1f} {b / r['tokens']:12.0f} {(b - ours) / sec:21.2f}"
        else:
            onehot = f"{'skipped: > cap' if r['onehot_skipped'] else 'failed':>15} {'-':>12} {'-':>21}"
        print(f"{r['tokens']:6} {r['capacity']:5} {sec:11} {ours / 2**20:9.1f} {ours / r['tokens']:13.0f} {onehot}")
    if len(rows) > 1:  # least-squares line: the slope is the marginal cost of a token
        s = [r["tokens"] for r in rows]
        m = [r["ours_extra_bytes"] for r in rows]
        s_mean, m_mean = statistics.fmean(s), statistics.fmean(m)
        slope = sum((a - s_mean) * (b - m_mean) for a, b in zip(s, m)) / sum((a - s_mean) ** 2 for a in s)
        fixed_mib = (m_mean - slope * s_mean) / 2**20
        print(f"ours: linear fit {slope:.0f} B/token + {fixed_mib:.1f} MiB fixed (mostly parameter gradients)")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.platform()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="*", help="grid of H (replaces the default grid)")
    parser.add_argument("--experts", type=int, nargs="*", help="grid of E")
    parser.add_argument("--topk", type=int, nargs="*", choices=[1, 2], help="grid of K")
    parser.add_argument("--tokens", type=int, nargs="*", help="grid of S; with several, also the memory sweep")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1, help="steps per implementation per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cap-gib", type=float, default=4.0, help="skip (b) where its [S,E,C] tensors exceed this")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory sweep")
    parser.add_argument("--quick", action="store_true", help="two small cases and a small memory sweep (< 1 min)")
    parser.add_argument("--output", help="JSON path (default benchmarks/results/moe_layer[_quick].json)")
    parser.add_argument("--memory-child", nargs=5, help=argparse.SUPPRESS)  # impl H E K S, internal
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.memory_child:
        memory_child(args.memory_child[0], Case(*map(int, args.memory_child[1:])))
        return
    if args.quick:
        grid, memory = QUICK_GRID, QUICK_MEMORY
    elif any(v is not None for v in (args.hidden, args.experts, args.topk, args.tokens)):
        hidden, experts = args.hidden or [512], args.experts or [16]
        topk, tokens = args.topk or [1], args.tokens or [4096]
        grid = [Case(*c) for c in itertools.product(hidden, experts, topk, tokens)]
        memory = [Case(hidden[0], experts[0], topk[0], s) for s in tokens] if len(tokens) > 1 else []
    else:
        grid, memory = DEFAULT_GRID, DEFAULT_MEMORY
    memory = [] if args.no_memory else memory
    cap_bytes = int(args.cap_gib * 2**30)
    rows = []
    for n, case in enumerate(grid, 1):
        rows.append(time_case(case, args.rounds, args.steps, args.warmup, cap_bytes))
        print(f"timed {n}/{len(grid)}: {case}", file=sys.stderr, flush=True)
    print(f"fp32 forward+backward of one layer, {torch.get_num_threads()} threads, median of {args.rounds} rounds"
          f" x {args.steps} steps; (a) dense H->K*4H->H, (b) one-hot [S,E,C] einsum dispatch")
    print_timing(rows)
    sys.stdout.flush()
    memory_rows = [measure_memory(case, cap_bytes) for case in memory]
    if memory_rows:
        print_memory(memory_rows)
    output = Path(args.output or f"benchmarks/results/moe_layer{'_quick' if args.quick else ''}.json")
    report = {"machine": platform.machine(), "processor": cpu_name(),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
              "args": {k: v for k, v in vars(args).items() if k != "memory_child"},
              "rows": rows, "memory_rows": memory_rows}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=1))
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
