"""Step time and per-rank memory of ZeRO stages 0-3 at 2 gloo ranks (one thread each) on a GPT of
about 50M parameters, trained through megatron.runtime.initialize on random tokens.

Each (stage, repetition) is its own run_distributed call: fresh processes, so the RSS peaks do
not mix and an earlier stage's heap cannot help a later one. Stages alternate in rounds (the order
reversed every other round) so machine drift hits them alike. Step time is the median over timed
steps after warm-up; the ratio to stage 0 is the median of per-round ratios.

Memory per rank, from tensor sizes: parameters (the module's; ZeRO adds an fp32 master shard;
under stage 3 the module's parameters are empty between uses, and what counts is the master shard
plus the most elements ever gathered at once, persistent small parameters included),
gradients after backward (the model's .grad) and when the optimizer steps (the model's .grad still
alive plus the shards' grads), optimizer state (engine.optimizer.state). Plus the process's peak
RSS above its RSS before the model was built (VmHWM after clear_refs).

Prints a table and writes JSON (default benchmarks/results/zero.json).
"""

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.moe_layer import cpu_name, proc_status_bytes
from megatron.model.config import GPTConfig
from megatron.model.gpt import GPTModel
from megatron.parallel import build_parallel_grid
from megatron.runtime import initialize
from tests.dist_utils import run_distributed

RANKS, STAGES = 2, (0, 1, 2, 3)
# about 52M parameters: 16 blocks of 12*H^2 plus a tied 4096 x 512 embedding (the embedding stays
# gathered through most of stage 3's backward, the LM head's use to the lookup's gradient)
MODEL = dict(
    num_layers=16,
    hidden_size=512,
    num_attention_heads=8,
    vocab_size=4096,
    max_position_embeddings=256,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
# stage 3 prefetches about one MLP matrix ahead (DeepSpeed's default, 5e7, would be the whole model)
STAGE3 = {"stage3_prefetch_bucket_size": 1_000_000}
MEMORY_KEYS = (
    "param_bytes",
    "master_bytes",
    "gathered_peak_bytes",
    "grad_backward_bytes",
    "grad_step_bytes",
    "optim_bytes",
    "peak_rss_delta",
)


def runtime_config(stage: int, micro_batch: int) -> dict:
    zero = {"stage": stage, **(STAGE3 if stage == 3 else {})}
    return {
        "train_batch_size": micro_batch * RANKS,
        "train_micro_batch_size_per_gpu": micro_batch,
        "zero_optimization": zero,
        "optimizer": {"params": {"lr": 1e-4}},
        "gradient_clipping": 1.0,
    }


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of distinct memory: overlapping views (of one flat buffer) count once."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for t in tensors:
        start = t.storage_offset() * t.element_size()
        spans.setdefault(t.untyped_storage().data_ptr(), []).append((start, start + t.numel() * t.element_size()))
    total = 0
    for ranges in spans.values():
        covered = 0
        for low, high in sorted(ranges):
            total += max(0, high - max(low, covered))
            covered = max(covered, high)
    return total


def rank_run(stage: int, micro_batch: int, warmup: int, steps: int) -> dict[str, torch.Tensor]:
    """One rank of one run: build, warm up, time `steps` steps; return step times and byte counts."""
    with open("/proc/self/clear_refs", "w") as clear_refs:  # peak RSS from here, not from import/spawn
        clear_refs.write("5")
    base_rss = proc_status_bytes("VmRSS")
    grid = build_parallel_grid(torch.device("cpu"))  # the process group is already up (dist_utils)
    torch.manual_seed(0)
    engine = initialize(GPTModel(GPTConfig(**MODEL)), runtime_config(stage, micro_batch), grid)
    params = list(engine.module.parameters())
    seen = {"grad_backward_bytes": 0, "grad_step_bytes": 0}
    inner_step = engine.optimizer.step

    def counting_step(*args: Any, **kwargs: Any) -> Any:  # the gradients alive when the optimizer reads them
        shard_grads = [p.shard.grad for p in engine.strategy.partitions if p.shard.grad is not None]
        seen["grad_step_bytes"] = tensor_bytes([p.grad for p in params if p.grad is not None] + shard_grads)
        return inner_step(*args, **kwargs)

    engine.optimizer.step = counting_step
    gather_s = [0.0]

    def timed_gather(inner=engine.strategy.after_step) -> None:  # the all-gather of updated shards
        start = time.perf_counter()
        inner()
        gather_s[0] += time.perf_counter() - start

    engine.strategy.after_step = timed_gather
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    step_s, phases_s = [], []  # phases: forward+backward, engine.step, of it all-gather
    for index in range(warmup + steps):
        tokens = torch.randint(
            0, MODEL["vocab_size"], (micro_batch, MODEL["max_position_embeddings"]), generator=generator
        )
        dist.barrier()  # every rank starts the step together: the time is the step, not the skew
        start = time.perf_counter()
        output = engine(tokens, labels_BS=tokens)
        engine.backward(output.losses_BS.mean() + output.router_loss)
        seen["grad_backward_bytes"] = tensor_bytes([p.grad for p in params if p.grad is not None])
        backward_done, gather_s[0] = time.perf_counter(), 0.0
        engine.step()
        if index >= warmup:
            step_s.append(time.perf_counter() - start)
            phases_s.append([backward_done - start, time.perf_counter() - backward_done, gather_s[0]])
    state = [t for s in engine.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    gatherer = getattr(engine.strategy, "gatherer", None)
    memory = {
        "param_bytes": tensor_bytes(params),
        "master_bytes": tensor_bytes([p.shard for p in engine.strategy.partitions]),
        "gathered_peak_bytes": 4 * gatherer.peak_live_numel if gatherer is not None else 0,
        "optim_bytes": tensor_bytes(state),
        "peak_rss_delta": proc_status_bytes("VmHWM") - base_rss,
        **seen,
    }
    return {
        "step_s": torch.tensor(step_s, dtype=torch.float64),
        "phases_s": torch.tensor(phases_s, dtype=torch.float64),
        "memory": torch.tensor([memory[k] for k in MEMORY_KEYS], dtype=torch.int64),
    }


def measure(
    stages: tuple[int, ...],
    micro_batch: int,
    warmup: int,
    steps: int,
    rounds: int,
) -> tuple[list[dict], list[dict[int, float]]]:
    """Run every stage `rounds` times, alternating; return one record per run and per-round medians."""
    runs, per_round = [], []
    for round_index in range(rounds):
        order = stages if round_index % 2 == 0 else stages[::-1]
        medians = {}
        for stage in order:
            started = time.perf_counter()
            results = run_distributed(rank_run, RANKS, stage, micro_batch, warmup, steps)
            # a step ends at the same collective on both ranks: take the slower rank per step
            step_s = torch.stack([r["step_s"] for r in results]).amax(0).tolist()
            medians[stage] = statistics.median(step_s)
            phases = torch.stack([r["phases_s"] for r in results]).amax(0).median(0).values.tolist()
            runs.append(
                {
                    "stage": stage,
                    "round": round_index,
                    "step_s": step_s,
                    "wall_s": time.perf_counter() - started,
                    "compute_s": phases[0],
                    "engine_step_s": phases[1],
                    "gather_s": phases[2],
                    "memory_per_rank": [dict(zip(MEMORY_KEYS, r["memory"].tolist())) for r in results],
                }
            )
            print(
                f"round {round_index} stage {stage}: median step {1000 * medians[stage]:.0f} ms "
                f"({runs[-1]['wall_s']:.0f} s with start-up)",
                flush=True,
            )
        per_round.append(medians)
    return runs, per_round


def summarise(stages: tuple[int, ...], runs: list[dict], per_round: list[dict[int, float]]) -> list[dict]:
    rows = []
    for stage in stages:
        mine = [r for r in runs if r["stage"] == stage]
        # byte counts are the same every run; rank 0's (shards are equal-sized, padding aside)
        memory = dict(mine[0]["memory_per_rank"][0])
        # what holds parameter values: stage 3 the master and its gathered working set (the
        # module's tensors are empty or views of it), otherwise the module's tensors and the master
        memory["resident_param_bytes"] = memory["master_bytes"] + (
            memory["gathered_peak_bytes"] if stage == 3 else memory["param_bytes"]
        )
        memory["peak_rss_delta"] = int(
            statistics.median(rank["peak_rss_delta"] for r in mine for rank in r["memory_per_rank"])
        )
        ratios = [m[stage] / m[0] for m in per_round]
        phases = {
            f"{k}_ms": 1000 * statistics.median(r[f"{k}_s"] for r in mine) for k in ("compute", "engine_step", "gather")
        }
        rows.append(
            {
                "stage": stage,
                "step_ms": 1000 * statistics.median(m[stage] for m in per_round),
                **phases,
                "ratio": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                **memory,
            }
        )
    base = rows[0]
    for row in rows:
        for key, name in (
            ("resident_param_bytes", "param"),
            ("grad_step_bytes", "grad_step"),
            ("optim_bytes", "optim"),
            ("peak_rss_delta", "peak_rss"),
        ):
            row[f"{name}_vs_stage0"] = row[key] / base[key]
    return rows


def verdict(row: dict) -> str:
    """Targets: stages 1 and 2 within 1.15x of stage 0's step time; stage 3 at most 0.6x of stage
    0's parameter memory."""
    if row["stage"] == 3:
        return "ok" if row["param_vs_stage0"] <= 0.6 else "BIG"
    return "ok" if row["stage"] == 0 or row["ratio"] <= 1.15 else "SLOW"


def print_table(rows: list[dict]) -> None:
    mib = 2**20
    print(
        f"\n{'stage':>5} {'step ms':>8} {'ratio':>6} {'range':>11} {'params':>7} {'master':>7} {'gathered':>8} "
        f"{'resident':>8} {'grad bwd':>8} {'grad opt':>8} {'optim':>7} {'peak RSS':>8}   (MiB per rank; x = vs stage 0)"
    )
    for r in rows:
        print(
            f"{r['stage']:>5} {r['step_ms']:8.0f} {r['ratio']:6.3f} {r['ratio_min']:5.3f}-{r['ratio_max']:.3f} "
            f"{r['param_bytes'] / mib:7.0f} {r['master_bytes'] / mib:7.0f} {r['gathered_peak_bytes'] / mib:8.0f} "
            f"{r['resident_param_bytes'] / mib:8.0f} {r['grad_backward_bytes'] / mib:8.0f} "
            f"{r['grad_step_bytes'] / mib:8.0f} {r['optim_bytes'] / mib:7.0f} {r['peak_rss_delta'] / mib:8.0f}   {verdict(r)}"
        )
        if r["stage"]:
            print(
                f"{'':>5} {'':>8} {'':>6} {'':>11} {'':>7} {'':>7} {'':>8} {r['param_vs_stage0']:7.2f}x {'':>8} "
                f"{r['grad_step_vs_stage0']:7.2f}x {r['optim_vs_stage0']:6.2f}x {r['peak_rss_vs_stage0']:7.2f}x"
            )
    print(f"\n{'stage':>5} {'fwd+bwd ms':>10} {'engine.step ms':>14} {'of it gather ms':>15}   (medians, slower rank)")
    for r in rows:
        print(f"{r['stage']:>5} {r['compute_ms']:10.0f} {r['engine_step_ms']:14.0f} {r['gather_ms']:15.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each stage, alternating")
    parser.add_argument("--stages", type=int, nargs="+", default=list(STAGES), help="stage 0 is always run")
    parser.add_argument("--output", default="benchmarks/results/zero.json")
    args = parser.parse_args()
    stages = tuple(sorted({0, *args.stages}))
    parameters = sum(p.numel() for p in GPTModel(GPTConfig(**MODEL)).parameters())
    print(
        f"GPT {parameters:,} parameters, {RANKS} gloo ranks x 1 thread, micro batch {args.micro_batch} "
        f"x {MODEL['max_position_embeddings']} tokens per rank"
    )
    runs, per_round = measure(stages, args.micro_batch, args.warmup, args.steps, args.rounds)
    rows = summarise(stages, runs, per_round)
    print_table(rows)
    report = {
        "machine": platform.machine(),
        "cpu": cpu_name(),
        "ranks": RANKS,
        "threads_per_rank": 1,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "model": {**MODEL, "parameters": parameters},
        "micro_batch": args.micro_batch,
        "warmup": args.warmup,
        "steps": args.steps,
        "rounds": args.rounds,
        "stage3_settings": STAGE3,
        "rows": rows,
        "runs": runs,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
