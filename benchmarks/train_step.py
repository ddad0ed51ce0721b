"""Time per iteration of our training step (Trainer.train_step: data loader, engine forward,
backward, gradient reduction, clipping, optimizer and LR schedule) against a bare PyTorch loop
written here (same model, same batches, same fused AdamW, same clipping), in the same run.

Prints a table and writes JSON (default benchmarks/results/train_step.json). The two loops are
interleaved in rounds so machine drift hits both alike; the reported ratio is the median of the
per-round ratios. Our loader runs in the main process (--num-workers 0): on a 2-core machine a
prefetching worker process competes with the compute threads.
"""

import argparse
import io
import json
import platform
import statistics
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path

import torch

from megatron.parallel import build_parallel_grid
from megatron.runtime.optimizer_factory import build_optimizer
from megatron.training.loop import Trainer
from megatron.training.step import GPTBatch
from tests.training_fixtures import tiny_config, write_corpus

CONFIGS = {
    "small": dict(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=128, micro_batch_size=8),
    "medium": dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256, micro_batch_size=8),
}


def bare_loop_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: GPTBatch, clip: float) -> None:
    losses = model(batch.tokens_BS, labels_BS=batch.labels_BS).losses_BS
    loss = (losses * batch.loss_mask_BS).sum() / batch.loss_mask_BS.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(name: str, shape: dict, corpus: str, steps: int, rounds: int) -> dict:
    iters = (steps * rounds + 1) * 2 + 4
    config = tiny_config(
        corpus,
        train_iters=iters,
        global_batch_size=shape["micro_batch_size"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_workers=0,
        max_position_embeddings=shape["seq_length"],
        **{k: v for k, v in shape.items() if k != "micro_batch_size"},
        micro_batch_size=shape["micro_batch_size"],
    )
    with redirect_stdout(io.StringIO()):
        trainer = Trainer(config, build_parallel_grid(torch.device("cpu")))
    data_iter = trainer.loader(trainer.train_data, 0)
    bare_model = type(trainer.engine.module)(trainer.model_config)
    bare_model.load_state_dict(trainer.engine.module.state_dict())
    bare_optimizer = build_optimizer(bare_model, trainer.runtime)
    fixed_batch = trainer._batch(trainer.loader(trainer.train_data, 0))
    ours_times, bare_times = [], []
    for _ in range(2):  # warm-up, not timed
        trainer.train_step(data_iter)
        bare_loop_step(bare_model, bare_optimizer, fixed_batch, trainer.runtime.gradient_clipping)
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            trainer.train_step(data_iter)
        ours_times.append((time.perf_counter() - start) / steps)
        start = time.perf_counter()
        for _ in range(steps):
            bare_loop_step(bare_model, bare_optimizer, fixed_batch, trainer.runtime.gradient_clipping)
        bare_times.append((time.perf_counter() - start) / steps)
    ours, bare = statistics.median(ours_times), statistics.median(bare_times)
    ratios = [o / b for o, b in zip(ours_times, bare_times)]
    tokens = shape["micro_batch_size"] * shape["seq_length"]
    params = sum(p.numel() for p in bare_model.parameters())
    return {
        "config": name,
        "parameters": params,
        "tokens_per_step": tokens,
        "ours_ms": 1000 * ours,
        "bare_ms": 1000 * bare,
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ours_tokens_per_s": tokens / ours,
        "bare_tokens_per_s": tokens / bare,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--output", default="benchmarks/results/train_step.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        corpus = write_corpus(Path(folder), documents=3000)
        rows = [measure(name, CONFIGS[name], corpus, args.steps, args.rounds) for name in args.configs]
    print(f"{'config':8} {'params':>10} {'ours ms':>9} {'bare ms':>9} {'ratio':>6} {'range':>13} {'ours tok/s':>11}")
    for r in rows:
        print(
            f"{r['config']:8} {r['parameters']:>10,} {r['ours_ms']:9.1f} {r['bare_ms']:9.1f} {r['ratio']:6.3f} "
            f"{r['ratio_min']:6.3f}-{r['ratio_max']:.3f} {r['ours_tokens_per_s']:11.0f}"
        )
    report = {
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
