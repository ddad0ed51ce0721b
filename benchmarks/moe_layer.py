"""Forward+backward time of one MoE layer (fp32) against DeepSpeed's `deepspeed.moe.layer.MoE` with
the same router and expert weights, (a) a dense MLP of equal active FLOPs per token (H -> k*4H -> H)
and (b) a GShard-style one-hot dispatch written here: top-k gating that builds [S, E, C] combine
weights and dispatch mask, einsum dispatch, batched experts over stacked weights, einsum combine.
All compute loss = (out * fixed_grad).sum() + router loss. Cases run with token dropping (capacity
factor 1.0, random token selection for top-1) and without; (b) only with.

Before timing, each case checks that ours and DeepSpeed's compute the same outputs and gradients
(routing made deterministic for the check: no random token selection, no sampled second expert,
top-1 without dropping, since DeepSpeed breaks capacity ties in top-1 in no fixed token order).
The implementations then run interleaved in rounds (training-mode routing, as users run it) so
machine drift hits them alike; each ratio is the median of the per-round ratios. Targets:
DeepSpeed/ours >= 1.1; ours/(a) <= 1.25; (b)/ours >= 2 from E = 16 up. Peak memory of one step is
measured per case in a fresh subprocess (peak RSS minus RSS after setup, Linux /proc), since CPU
torch has no allocator statistics; target: ours per token <= DeepSpeed's. DeepSpeed is a
benchmark-only dependency: without it, its column is skipped with a note. Prints tables and writes
JSON (default benchmarks/results/moe_layer.json).

Legend: S tokens, H hidden, F = 4H expert ffn hidden, E experts, K top-k, C capacity per expert.
"""

import argparse
import contextlib
import ctypes
import importlib.util
import io
import itertools
import json
import logging
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.model.moe import MoEConfig, MoELayer
from megatron.model.moe.layer import MoEOutput
from megatron.model.moe.router import gumbel_like

IMPLS = ("ours", "deepspeed", "dense", "onehot")
CAPACITY_FACTOR, MIN_CAPACITY, AUX_COEFF = 1.0, 4, 0.01


class Case(NamedTuple):
    hidden: int
    experts: int
    topk: int
    tokens: int
    drop: bool = True


def both_drop_modes(cases: list[Case]) -> list[Case]:
    return [c._replace(drop=d) for d in (True, False) for c in cases]


DEFAULT_GRID = both_drop_modes(
    [Case(512, e, k, 4096) for k in (1, 2) for e in (8, 16, 32, 64)]
    + [Case(1024, e, 1, 4096) for e in (16, 64)]
    + [Case(512, 16, 1, s) for s in (2048, 8192, 16384)]
)
QUICK_GRID = both_drop_modes([Case(256, 8, 1, 1024), Case(256, 16, 2, 1024)])


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
        combine_SEC = torch.einsum(
            "se,sc->sec", (gate1_S / denom_S)[:, None] * first_SE, F.one_hot((slot1_SE * first_SE).sum(1), cap).float()
        )
        return l_aux, combine_SEC + torch.einsum(
            "se,sc->sec",
            (gate2_S / denom_S)[:, None] * second_SE,
            F.one_hot((slot2_SE * second_SE).sum(1), cap).float(),
        )

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


def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def start_deepspeed() -> Any:
    """DeepSpeed's comm layer over a one-process gloo group (its MoE layer needs one for its expert
    groups), its CPU accelerator and its logs quiet. Returns the deepspeed module."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with contextlib.redirect_stdout(io.StringIO()):
        import deepspeed
        from deepspeed.utils import logger

        logger.setLevel(logging.WARNING)
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    return deepspeed


def moe_config(case: Case, deterministic: bool = False) -> MoEConfig:
    """As users train; `deterministic` routes without random choices (see the module's docstring)."""
    return MoEConfig(
        topk=case.topk,
        train_capacity_factor=CAPACITY_FACTOR,
        min_capacity=MIN_CAPACITY,
        drop_tokens=case.drop and not (deterministic and case.topk == 1),
        use_rts=not deterministic,
        sample_second_expert=not deterministic,
        aux_loss_coeff=AUX_COEFF,
    )


def build_ours(case: Case, config: MoEConfig, ep_group: dist.ProcessGroup | None = None) -> MoELayer:
    torch.manual_seed(0)  # same weights for every run of a case (and the same router on every EP rank)
    h = case.hidden
    return MoELayer(
        h, 4 * h, case.experts, config, init_std=0.02, output_init_std=0.02 / math.sqrt(24), ep_group=ep_group
    )


@torch.no_grad()
def build_deepspeed(ours: MoELayer, config: MoEConfig, ep_size: int = 1) -> nn.Module:
    """DeepSpeed's layer (experts: Linear, GELU, Linear with biases) holding our router and this rank's
    experts: with ep_size > 1 its local expert i on rank r is global expert r * E_l + i, as ours."""
    deepspeed = start_deepspeed()
    h, num_experts = ours.router.weight.shape[1], ours.num_experts
    expert = nn.Sequential(nn.Linear(h, ours.experts.w1.shape[2]), nn.GELU(), nn.Linear(ours.experts.w1.shape[2], h))
    with contextlib.redirect_stdout(io.StringIO()):
        layer = deepspeed.moe.layer.MoE(
            h,
            expert,
            num_experts,
            ep_size=ep_size,
            k=config.topk,
            capacity_factor=config.train_capacity_factor,
            min_capacity=config.min_capacity,
            drop_tokens=config.drop_tokens,
            use_rts=config.use_rts,
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


def build(impl: str, case: Case) -> nn.Module:
    if impl in ("ours", "deepspeed"):
        ours = build_ours(case, moe_config(case))
        return ours if impl == "ours" else build_deepspeed(ours, moe_config(case))
    torch.manual_seed(0)
    h, ffn = case.hidden, 4 * case.hidden
    if impl == "dense":
        return DenseMLP(h, case.topk * ffn)
    return OneHotMoE(h, ffn, case.experts, case.topk)


def inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Input [1, S, H] that needs a gradient, as inside a model, and a fixed output gradient."""
    torch.manual_seed(1)
    x = torch.randn(1, case.tokens, case.hidden, requires_grad=True)
    return x, torch.randn(x.shape)


def output_and_router_loss(outputs: MoEOutput | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ours returns an MoEOutput, the baselines here (out, weighted router loss), DeepSpeed's MoE
    (out, unweighted l_aux, expert counts)."""
    if isinstance(outputs, MoEOutput):
        return outputs.hidden_BSH, outputs.router_loss
    out, router_loss = outputs[:2]
    return out, AUX_COEFF * router_loss if len(outputs) == 3 else router_loss


def forward_backward(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """loss = (out * grad).sum() + weighted router loss, backward; returns the output."""
    out, router_loss = output_and_router_loss(model(x))
    ((out * grad).sum() + router_loss).backward()
    return out.detach()


def step(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
    forward_backward(model, x, grad)
    model.zero_grad(set_to_none=True)
    x.grad = None


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal up to float32 summation order: the norm of the difference within 1e-5 of the norm."""
    error = (got - want).norm() / want.norm().clamp(min=1e-30)
    if not error <= 1e-5:
        raise AssertionError(f"ours and DeepSpeed's {what} differ: relative error {error:.2e}")


def check_same_as_deepspeed(case: Case) -> None:
    """Outputs, input gradients and parameter gradients of ours and DeepSpeed's layer agree."""
    ours = build_ours(case, moe_config(case, deterministic=True))
    assert_same(ours, build_deepspeed(ours, moe_config(case, deterministic=True)), *inputs(case), str(case))


def assert_same(ours: MoELayer, theirs: nn.Module, x: torch.Tensor, grad: torch.Tensor, what: str) -> None:
    """One forward+backward of each on x: outputs, input and parameter gradients agree."""
    out = forward_backward(ours, x, grad)
    x_grad, x.grad = x.grad, None
    assert_close(forward_backward(theirs, x, grad), out, f"{what} outputs")
    assert_close(x.grad, x_grad, f"{what} input gradients")
    for name, got, want in matching_tensors(ours, theirs, grads=True):
        assert_close(got, want, f"{what} {name} gradients")


def impls_of(case: Case, wanted: list[str], cap_bytes: int) -> list[str]:
    """(b) only drops tokens, and only fits in memory up to `cap_bytes`."""
    return [i for i in wanted if i != "onehot" or (case.drop and onehot_bytes(case) <= cap_bytes)]


def median_ratio(numerators: list[float], denominators: list[float]) -> dict[str, Any]:
    ratios = [a / b for a, b in zip(numerators, denominators)]
    return {"median": statistics.median(ratios), "range": [min(ratios), max(ratios)]}


def time_case(case: Case, impls: list[str], rounds: int, steps: int, warmup: int) -> dict:
    if "deepspeed" in impls:
        check_same_as_deepspeed(case)
    models, (x, grad) = {i: build(i, case) for i in impls}, inputs(case)
    for impl in impls:  # warm-up: kernels, allocator, the grouped-GEMM probe
        for _ in range(warmup):
            step(models[impl], x, grad)
    times: dict[str, list[float]] = {i: [] for i in impls}
    faults: dict[str, list[float]] = {i: [] for i in impls}
    system: dict[str, list[float]] = {i: [] for i in impls}
    for _ in range(rounds):
        for impl in impls:
            usage, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            for _ in range(steps):
                step(models[impl], x, grad)
            times[impl].append((time.perf_counter() - start) / steps)
            after = resource.getrusage(resource.RUSAGE_SELF)
            faults[impl].append((after.ru_minflt - usage.ru_minflt) / steps)
            system[impl].append((after.ru_stime - usage.ru_stime) / steps)
    row = {**case._asdict(), "capacity": capacity(case), "onehot_est_bytes": onehot_bytes(case)}
    row.update({f"{i}_ms": 1000 * statistics.median(times[i]) for i in impls})
    # fresh pages the kernel zeroes and maps in (new large tensors), and the system time they cost
    row.update({f"{i}_page_faults": statistics.median(faults[i]) for i in impls})
    row.update({f"{i}_system_ms": 1000 * statistics.median(system[i]) for i in impls})
    row["ours_over_dense"] = median_ratio(times["ours"], times["dense"])
    if "deepspeed" in impls:
        row["deepspeed_over_ours"] = median_ratio(times["deepspeed"], times["ours"])
    if "onehot" in impls:
        row["onehot_over_ours"] = median_ratio(times["onehot"], times["ours"])
    return row


def proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


def memory_child(impl: str, case: Case) -> None:
    """Runs in a fresh process: one step of a throwaway copy of the model warms up what a process
    sets up once (libraries, kernels compiled per shape, probes); then one step of the measured
    model, whose peak RSS above the RSS before it is printed. That includes everything the step
    allocates, our reused gradient buffers too. Not ru_maxrss: Linux carries the parent's RSS at fork
    into it across exec. Writing 5 to clear_refs resets this process's VmHWM instead."""
    model, (x, grad) = build(impl, case), inputs(case)
    step(build(impl, case), x, grad)
    release_free_heap()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    base = proc_status_bytes("VmRSS")
    step(model, x, grad)
    print(json.dumps({"extra_bytes": proc_status_bytes("VmHWM") - base}))


def release_free_heap() -> None:
    """glibc keeps freed heap memory mapped (the warm-up's activations and DeepSpeed's per-expert
    gradients): hand it back, so that no implementation's step starts on memory its warm-up left."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def measure_memory(case: Case, impls: list[str], threads: int, repeats: int) -> dict:
    """Median over `repeats` fresh processes per implementation, taken in turns: one process's peak
    moves by up to a third with the heap's state (DeepSpeed's most)."""
    row: dict[str, Any] = {**case._asdict(), "capacity": capacity(case)}
    samples: dict[str, list[int]] = {impl: [] for impl in impls}
    for _ in range(repeats):
        for impl in impls:
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.moe_layer",
                "--threads",
                str(threads),
                "--memory-child",
                impl,
                *(str(int(v)) for v in case),
            ]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:  # e.g. killed for memory: say so and keep the other rows
                print(f"memory step of {impl} for {case} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            samples[impl].append(json.loads(done.stdout.strip().splitlines()[-1])["extra_bytes"])
    for impl, values in samples.items():
        if values:
            row[f"{impl}_extra_bytes"] = statistics.median(values)
            row[f"{impl}_extra_bytes_range"] = [min(values), max(values)]
    if "ours_extra_bytes" in row and "deepspeed_extra_bytes" in row:
        row["ours_over_deepspeed_bytes"] = row["ours_extra_bytes"] / row["deepspeed_extra_bytes"]
    return row


def ratio_cell(value: float, ok: bool | None) -> str:
    return f"{value:6.2f} {'  - ' if ok is None else 'PASS' if ok else 'FAIL'}"


def case_cells(r: dict) -> str:
    return (
        f"{r['hidden']:5} {r['experts']:3} {r['topk']:2} {r['tokens']:6} {'yes' if r['drop'] else 'no':>4}"
        f" {r['capacity'] if r['drop'] else '-':>5}"
    )


def print_timing(rows: list[dict]) -> None:
    print(
        f"{'H':>5} {'E':>3} {'K':>2} {'tokens':>6} {'drop':>4} {'C':>5} {'ours ms':>8} {'DS ms':>8} {'(a) ms':>8}"
        f" {'(b) ms':>8} {'DS/ours>=1.1':>13} {'ours/(a)<=1.25':>15} {'(b)/ours>=2':>12}"
    )
    for r in rows:
        cells = [
            f"{r[k]:8.1f}" if k in r else f"{'-':>8}" for k in ("ours_ms", "deepspeed_ms", "dense_ms", "onehot_ms")
        ]
        ds = (
            ratio_cell(r["deepspeed_over_ours"]["median"], r["deepspeed_over_ours"]["median"] >= 1.1)
            if "deepspeed_over_ours" in r
            else "-"
        )
        dense = ratio_cell(r["ours_over_dense"]["median"], r["ours_over_dense"]["median"] <= 1.25)
        onehot = "-"
        if "onehot_over_ours" in r:  # the speedup target applies from 16 experts up
            value = r["onehot_over_ours"]["median"]
            onehot = ratio_cell(value, value >= 2 if r["experts"] >= 16 else None)
        print(f"{case_cells(r)} {' '.join(cells)} {ds:>13} {dense:>15} {onehot:>12}")


def print_page_faults(rows: list[dict]) -> None:
    """Minor page faults and system time per step (medians over the rounds), which swing with the
    host's state more than the arithmetic does."""
    print("\npage faults and system time per step")
    print(
        f"{'H':>5} {'E':>3} {'K':>2} {'tokens':>6} {'drop':>4} {'C':>5} {'ours faults':>12} {'ours sys ms':>12}"
        f" {'DS faults':>10} {'DS sys ms':>10}"
    )
    for r in rows:
        cells = [
            f"{r[f'{impl}_page_faults']:{width}.0f} {r[f'{impl}_system_ms']:{width}.1f}"
            if f"{impl}_page_faults" in r
            else f"{'-':>{width}} {'-':>{width}}"
            for impl, width in (("ours", 12), ("deepspeed", 10))
        ]
        print(f"{case_cells(r)} {' '.join(cells)}")


def print_memory(rows: list[dict]) -> None:
    """Peak extra bytes of one step per token, ours against DeepSpeed's (and (b) where run)."""
    print("\npeak extra memory of one forward+backward, bytes per token")
    print(
        f"{'H':>5} {'E':>3} {'K':>2} {'tokens':>6} {'drop':>4} {'C':>5} {'ours MiB':>9} {'ours B/tok':>10}"
        f" {'DS MiB':>8} {'DS B/tok':>9} {'(b) B/tok':>10} {'ours/DS<=1':>11}"
    )
    for r in rows:
        cells = []
        for impl, width in (("ours", 9), ("deepspeed", 8)):
            b = r.get(f"{impl}_extra_bytes")
            cells.append(
                f"{b / 2**20:{width}.1f} {b / r['tokens']:{width + 1}.0f}"
                if b
                else f"{'-':>{width}} {'-':>{width + 1}}"
            )
        onehot = r.get("onehot_extra_bytes")
        cells.append(f"{onehot / r['tokens']:10.0f}" if onehot else f"{'-':>10}")
        ratio = r.get("ours_over_deepspeed_bytes")
        cells.append(ratio_cell(ratio, ratio <= 1) if ratio else "-")
        print(f"{case_cells(r)} {' '.join(cells)}")
    for impl in ("ours", "deepspeed"):
        print_memory_fit(rows, impl)


def print_memory_fit(rows: list[dict], impl: str) -> None:
    """Least-squares line over a token sweep (cases that differ only in tokens): the slope is the
    marginal cost of a token, the intercept mostly parameter gradients."""
    sweeps: dict[tuple, list[dict]] = {}
    for r in rows:
        if f"{impl}_extra_bytes" in r:
            sweeps.setdefault((r["hidden"], r["experts"], r["topk"], r["drop"]), []).append(r)
    for (h, e, k, drop), sweep in sweeps.items():
        s = [r["tokens"] for r in sweep]
        if len(set(s)) < 2:
            continue
        m = [r[f"{impl}_extra_bytes"] for r in sweep]
        s_mean, m_mean = statistics.fmean(s), statistics.fmean(m)
        slope = sum((a - s_mean) * (b - m_mean) for a, b in zip(s, m)) / sum((a - s_mean) ** 2 for a in s)
        print(
            f"{impl} H={h} E={e} K={k} drop={drop}: {slope:.0f} B/token + {(m_mean - slope * s_mean) / 2**20:.1f} MiB"
        )


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
    parser.add_argument("--tokens", type=int, nargs="*", help="grid of S")
    parser.add_argument("--drop", choices=["both", "yes", "no"], default="both", help="token dropping cases")
    parser.add_argument("--impls", nargs="*", choices=IMPLS, default=list(IMPLS), help="columns to run (ours always)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1, help="steps per implementation per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cap-gib", type=float, default=4.0, help="skip (b) where its [S,E,C] tensors exceed this")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    parser.add_argument("--memory-repeats", type=int, default=3, help="fresh processes per implementation and case")
    parser.add_argument("--quick", action="store_true", help="four small cases (< 1 min)")
    parser.add_argument(
        "--ep-size",
        type=int,
        choices=[1, 2],
        default=1,
        help="2: expert parallelism over two gloo processes of one thread each (benchmarks/moe_ep.py),"
        " against DeepSpeed's MoE(ep_size=2), with the share of the step in each phase",
    )
    parser.add_argument("--profile-steps", type=int, default=3, help="with --ep-size 2: instrumented steps per column")
    parser.add_argument(
        "--output",
        help="JSON path (default benchmarks/results/moe_layer[_quick].json, moe_ep[_quick].json with --ep-size 2)",
    )
    parser.add_argument("--memory-child", nargs=6, help=argparse.SUPPRESS)  # impl H E K S drop, internal
    return parser.parse_args()


def grid_of(args: argparse.Namespace) -> list[Case]:
    if args.quick:
        grid = QUICK_GRID
    elif any(v is not None for v in (args.hidden, args.experts, args.topk, args.tokens)):
        grid = both_drop_modes(
            [
                Case(*c)
                for c in itertools.product(
                    args.hidden or [512], args.experts or [16], args.topk or [1], args.tokens or [4096]
                )
            ]
        )
    else:
        grid = DEFAULT_GRID
    return [c for c in grid if args.drop == "both" or c.drop == (args.drop == "yes")]


def wanted_impls(args: argparse.Namespace) -> list[str]:
    wanted = ["ours"] + [i for i in IMPLS if i in args.impls and i != "ours"]
    if "deepspeed" in wanted and not deepspeed_available():
        print("note: deepspeed is not installed here; its column is skipped", file=sys.stderr)
        wanted.remove("deepspeed")
    if "dense" not in wanted:
        wanted.append("dense")  # the ours/(a) ratio is always reported
    return wanted


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        impl, *numbers = args.memory_child
        memory_child(impl, Case(*map(int, numbers[:4]), bool(int(numbers[4]))))
        return
    if args.ep_size == 2:
        run_expert_parallel(args)
        return
    grid, wanted, cap_bytes = grid_of(args), wanted_impls(args), int(args.cap_gib * 2**30)
    rows = []
    for n, case in enumerate(grid, 1):
        rows.append(time_case(case, impls_of(case, wanted, cap_bytes), args.rounds, args.steps, args.warmup))
        print(f"timed {n}/{len(grid)}: {case}", file=sys.stderr, flush=True)
    print(
        f"fp32 forward+backward of one layer, {torch.get_num_threads()} threads, median of {args.rounds} rounds"
        f" x {args.steps} steps; DS DeepSpeed {'(not installed)' if 'deepspeed' not in wanted else ''},"
        f" (a) dense H->K*4H->H, (b) one-hot [S,E,C] einsum dispatch"
    )
    print_timing(rows)
    print_page_faults(rows)
    sys.stdout.flush()
    memory_rows = (
        []
        if args.no_memory
        else [
            measure_memory(
                c,
                [i for i in impls_of(c, wanted, cap_bytes) if i != "dense"],
                torch.get_num_threads(),
                args.memory_repeats,
            )
            for c in grid
        ]
    )
    if memory_rows:
        print_memory(memory_rows)
    output = Path(args.output or f"benchmarks/results/moe_layer{'_quick' if args.quick else ''}.json")
    report = {
        "machine": platform.machine(),
        "processor": cpu_name(),
        "torch": torch.__version__,
        "deepspeed": deepspeed_version() if "deepspeed" in wanted else None,
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d"),
        "args": {k: v for k, v in vars(args).items() if k != "memory_child"},
        "rows": rows,
        "memory_rows": memory_rows,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=1))
    print(f"wrote {output}")


def run_expert_parallel(args: argparse.Namespace) -> None:
    """EP=2 mode: moe_ep's own grid unless one is given (its cases take two processes each)."""
    from benchmarks import moe_ep  # it builds on this module, so it is imported once this one is loaded

    custom = any(v is not None for v in (args.hidden, args.experts, args.topk, args.tokens))
    grid = moe_ep.QUICK_GRID if args.quick else grid_of(args) if custom else moe_ep.DEFAULT_GRID
    output = Path(args.output or f"benchmarks/results/moe_ep{'_quick' if args.quick else ''}.json")
    moe_ep.run_and_report(grid, args, "deepspeed" in wanted_impls(args), output)


def deepspeed_version() -> str:
    """The installed DeepSpeed's version, read from its metadata (no import, no process group)."""
    return version("deepspeed")


if __name__ == "__main__":
    main()
