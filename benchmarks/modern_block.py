"""Step time of one MoE transformer block built the modern way against the classic (2021) block of
equal parameters: forward+backward, fp32, on the CPU, through the model's own code (a one-layer
`GPTModel` whose only layer is MoE; its `TransformerBlock` is timed alone, with position ids).

- classic: LayerNorm, multi-head attention with biases, E GELU experts H -> 4H -> H with biases,
  DeepSpeed's top-2 routing (training mode: Gumbel-sampled second expert).
- modern: RMSNorm, grouped-query attention (a quarter as many key/value heads as query heads),
  rope, no linear biases, SwiGLU experts, 2E fine-grained routed experts of width F with top-4
  routing, and one shared expert of the same width F (DeepSeek-MoE's layout).

Equal parameters: SwiGLU's three matrices of width 2/3 * 4H hold what GELU's two of width 4H hold,
and splitting each expert in two (granularity 2, twice the experts and twice the top-k) keeps both
the total and the active expert parameters, so routed experts F = 4H/3 wide alone would match the
classic experts. GQA drops 1.5 H^2 of key/value projections and the shared expert adds one more
width-F expert; the script puts the difference back into F, solving for the F (a multiple of 8) at
which the block's parameter count, counted on the meta device, comes closest to the classic
block's: F = 1.28-1.31 H, within 1% (the table's column par m/c). Every token then goes through
5 width-F SwiGLU experts against the classic's 2 GELU ones: 8-11% more active parameters and
8-10% more FLOPs per token, both reported (`megatron.model_size.model_size` and
`GPTConfig.flops_per_token`, embeddings and head left out), with the time ratio per FLOP.

Dropout is off in both (it is not what differs). Routing is dropless by default, so each expert
computes every row routed to it and the work matches the FLOPs count; --drop-tokens uses capacity
factor 1.0 in both. The two blocks run interleaved in rounds (order alternating), so machine drift
hits them alike; times are medians over rounds and the ratio modern/classic is the median of the
per-round ratios. The load average is recorded before and after each thread count, and a note
printed where it is above 2.5. Prints a table and writes JSON (default
benchmarks/results/modern_block[_quick].json). Run it as `python -m benchmarks.modern_block`.

Legend: H hidden, E classic experts, F modern expert width, S sequence, B batch, T = B * S tokens.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from benchmarks.moe_layer import cpu_name, median_ratio, step
from megatron.model import GPTConfig, GPTModel
from megatron.model.moe import MoEConfig
from megatron.model_size import model_size

BLOCKS = ("classic", "modern")
HEAD_DIM, HEADS_PER_KV_HEAD, GRANULARITY, CLASSIC_TOPK = 64, 4, 2, 2
LOAD_LIMIT = 2.5  # above this load average, the table is not to be trusted on a 2-core machine


class Case(NamedTuple):
    hidden: int
    experts: int  # the classic block's; the modern one has GRANULARITY times as many
    seq: int
    batch: int

    @property
    def tokens(self) -> int:
        return self.seq * self.batch


DEFAULT_GRID = [Case(512, 8, 512, 8), Case(512, 16, 512, 8), Case(1024, 8, 1024, 2), Case(1024, 16, 1024, 2)]
QUICK_GRID = [Case(256, 8, 256, 4)]


def classic_config(case: Case, drop_tokens: bool) -> GPTConfig:
    """One MoE layer of the 2021 recipe. No vocabulary: the block is all that model_size counts here."""
    return GPTConfig(
        num_layers=1,
        hidden_size=case.hidden,
        num_attention_heads=case.hidden // HEAD_DIM,
        vocab_size=0,
        max_position_embeddings=case.seq,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_experts=(case.experts,),
        expert_interval=1,
        moe=MoEConfig(topk=CLASSIC_TOPK, drop_tokens=drop_tokens),
    )


def modern_config(case: Case, drop_tokens: bool, ffn: int) -> GPTConfig:
    heads = case.hidden // HEAD_DIM
    return replace(
        classic_config(case, drop_tokens),
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        num_query_groups=heads // HEADS_PER_KV_HEAD,
        position_embedding_type="rope",
        num_experts=(GRANULARITY * case.experts,),
        moe_ffn_hidden_size=ffn,
        moe_shared_expert_intermediate_size=ffn,
        moe=MoEConfig(topk=GRANULARITY * CLASSIC_TOPK, drop_tokens=drop_tokens),
    )


def block_params(config: GPTConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPTModel(config).layers.parameters())


def matching_ffn(case: Case, drop_tokens: bool) -> int:
    """The modern expert width F (a multiple of 8) whose block has the classic block's parameter
    count most nearly: the count is linear in F, so two counts give the line to solve."""
    target = block_params(classic_config(case, drop_tokens))
    low, high = (block_params(modern_config(case, drop_tokens, f)) for f in (8, 16))
    exact = 8 + 8 * (target - low) / (high - low)
    return min(
        (8 * round(exact / 8) + d for d in (-8, 0, 8)),
        key=lambda f: abs(block_params(modern_config(case, drop_tokens, f)) - target),
    )


def block_size(config: GPTConfig, seq: int) -> dict[str, float]:
    """Total and active parameters and training FLOPs per token of the one block: model_size's,
    less what lies outside the layers (learned positions, final norm; the vocabulary is empty)."""
    size, params = model_size(config, seq), block_params(config)
    return {
        "params": params,
        "active_params": size.active - (size.total - params),
        "flops_per_token": size.flops_per_token,
    }


class WithPositions(nn.Module):
    """The block as moe_layer.step calls a layer, x -> (out, router loss), at fixed positions."""

    def __init__(self, block: nn.Module, position_ids_BS: torch.Tensor) -> None:
        super().__init__()
        self.block, self.position_ids_BS = block, position_ids_BS

    def forward(self, x_BSH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        output = self.block(x_BSH, self.position_ids_BS)
        return output.hidden_BSH, output.router_loss


def build_block(config: GPTConfig, case: Case) -> nn.Module:
    torch.manual_seed(0)
    positions_BS = torch.arange(case.seq).expand(case.batch, case.seq)
    return WithPositions(GPTModel(config).layers[0], positions_BS).train()


def inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Input [B, S, H] that needs a gradient, as inside a model, and a fixed output gradient."""
    torch.manual_seed(1)
    x = torch.randn(case.batch, case.seq, case.hidden, requires_grad=True)
    return x, torch.randn(x.shape)


def time_case(case: Case, drop_tokens: bool, rounds: int, warmup: int) -> dict[str, Any]:
    ffn = matching_ffn(case, drop_tokens)
    configs = {"classic": classic_config(case, drop_tokens), "modern": modern_config(case, drop_tokens, ffn)}
    blocks, (x, grad) = {name: build_block(c, case) for name, c in configs.items()}, inputs(case)
    for name in BLOCKS:
        for _ in range(warmup):
            step(blocks[name], x, grad)
    times: dict[str, list[float]] = {name: [] for name in BLOCKS}
    for n in range(rounds):
        for name in BLOCKS if n % 2 == 0 else BLOCKS[::-1]:
            start = time.perf_counter()
            step(blocks[name], x, grad)
            times[name].append(time.perf_counter() - start)
    row: dict[str, Any] = {
        **case._asdict(),
        "tokens": case.tokens,
        "threads": torch.get_num_threads(),
        "modern_expert_ffn": ffn,
        "modern_experts": GRANULARITY * case.experts,
    }
    for name in BLOCKS:
        seconds = statistics.median(times[name])
        size = block_size(configs[name], case.seq)
        row[name] = {
            **size,
            "ms": 1000 * seconds,
            "ms_per_round": [1000 * t for t in times[name]],
            "tokens_per_s": case.tokens / seconds,
            "gflops": size["flops_per_token"] * case.tokens / seconds / 1e9,
        }
    row["params_modern_over_classic"] = row["modern"]["params"] / row["classic"]["params"]
    row["modern_over_classic"] = median_ratio(times["modern"], times["classic"])
    # the time ratio over the FLOPs ratio: above 1, the modern block runs at lower GFLOP/s
    row["modern_over_classic_per_flop"] = (
        row["modern_over_classic"]["median"] * row["classic"]["flops_per_token"] / row["modern"]["flops_per_token"]
    )
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'thr':>3} {'H':>5} {'E':>3} {'2E':>3} {'F':>5} {'B x S':>9} {'params M':>8} {'par m/c':>7}"
        f" {'active M c/m':>13} {'GFLOP/tok c/m':>13} {'classic ms':>10} {'modern ms':>9} {'m/c':>5} {'range':>11}"
        f" {'per FLOP':>8} {'tok/s c/m':>11} {'GFLOP/s c/m':>11}"
    )
    for r in rows:
        c, m, ratio = r["classic"], r["modern"], r["modern_over_classic"]
        print(
            f"{r['threads']:3} {r['hidden']:5} {r['experts']:3} {r['modern_experts']:3} {r['modern_expert_ffn']:5}"
            f" {r['batch']:>3} x {r['seq']:<4} {c['params'] / 1e6:8.2f} {r['params_modern_over_classic']:7.4f}"
            f" {c['active_params'] / 1e6:6.2f}/{m['active_params'] / 1e6:<6.2f}"
            f" {c['flops_per_token'] / 1e9:6.3f}/{m['flops_per_token'] / 1e9:<6.3f}"
            f" {c['ms']:10.1f} {m['ms']:9.1f} {ratio['median']:5.2f}"
            f" {ratio['range'][0]:5.2f}-{ratio['range'][1]:<5.2f} {r['modern_over_classic_per_flop']:8.2f}"
            f" {c['tokens_per_s']:5.0f}/{m['tokens_per_s']:<5.0f} {c['gflops']:5.1f}/{m['gflops']:<5.1f}"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="*", help="grid of H (replaces the default grid)")
    parser.add_argument("--num-experts", type=int, nargs="*", help="grid of the classic block's E")
    parser.add_argument("--seq", type=int, nargs="*", help="grid of S")
    parser.add_argument("--batch", type=int, nargs="*", help="grid of B")
    parser.add_argument(
        "--drop-tokens", action="store_true", help="capacity factor 1.0 in both blocks (default: dropless)"
    )
    parser.add_argument("--threads", type=int, nargs="*", help="torch thread counts to run in turn (default: torch's)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds, one step of each block per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each block first")
    parser.add_argument("--quick", action="store_true", help="one small case (seconds)")
    parser.add_argument("--output", "--json", help="JSON path (default benchmarks/results/modern_block[_quick].json)")
    return parser.parse_args()


def grid_of(args: argparse.Namespace) -> list[Case]:
    if args.quick:
        return QUICK_GRID
    if all(v is None for v in (args.hidden, args.num_experts, args.seq, args.batch)):
        return DEFAULT_GRID
    return [
        Case(h, e, s, b)
        for h in args.hidden or [512]
        for e in args.num_experts or [8]
        for s in args.seq or [512]
        for b in args.batch or [8]
    ]


def checked_load(when: str) -> float:
    load = os.getloadavg()[0]
    if load > LOAD_LIMIT:
        print(
            f"note: load average {load:.2f} {when}, above {LOAD_LIMIT}: other work may have disturbed the times",
            file=sys.stderr,
        )
    return load


def main() -> None:
    args = parse_args()
    grid, rows, loads, started = grid_of(args), [], [], time.perf_counter()
    for threads in args.threads or [torch.get_num_threads()]:
        torch.set_num_threads(threads)
        before = checked_load(f"before the {threads}-thread runs")
        for n, case in enumerate(grid, 1):
            rows.append(time_case(case, args.drop_tokens, args.rounds, args.warmup))
            print(f"timed {n}/{len(grid)} at {threads} threads: {case}", file=sys.stderr, flush=True)
        loads.append({"threads": threads, "before": before, "after": checked_load(f"after the {threads}-thread runs")})
    print(
        f"fp32 forward+backward of one MoE block, median of {args.rounds} interleaved rounds, routing "
        f"{'capacity factor 1.0' if args.drop_tokens else 'dropless'}; c classic (top-{CLASSIC_TOPK} of E GELU experts"
        f" 4H wide), m modern (top-{GRANULARITY * CLASSIC_TOPK} of 2E SwiGLU experts F wide + 1 shared); m/c the median"
        " of per-round ratios, per FLOP that over the ratio of FLOPs per token; load average before-after "
        + ", ".join(f"{load['before']:.2f}-{load['after']:.2f}" for load in loads)
    )
    print_table(rows)
    elapsed = time.perf_counter() - started
    print(f"took {elapsed:.0f} s")
    output = Path(args.output or f"benchmarks/results/modern_block{'_quick' if args.quick else ''}.json")
    report = {
        "machine": platform.machine(),
        "processor": cpu_name(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "load_average": loads,
        "elapsed_s": elapsed,
        "args": vars(args),
        "rows": rows,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=1))
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
