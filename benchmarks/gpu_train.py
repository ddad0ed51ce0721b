"""Short training runs of a GPT-125M-sized model on one GPU: tokens/s and model FLOPs
utilisation (MFU) against the GPU's peak, for each precision asked. Prints a table, writes JSON.

Synthetic data (a random bigram corpus over a GPT-2-sized vocabulary) so no download is needed.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from megatron.parallel import build_parallel_grid
from megatron.training.loop import Trainer
from tests.training_fixtures import tiny_config, write_corpus

VOCAB = 50257
MODEL_125M = dict(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024)


def run(corpus: str, precision: str, iters: int, micro_batch: int, shape: dict, peak_tflops: float) -> dict:
    extra = {"bf16": {"bf16": True}, "fp16": {"fp16": True, "initial_loss_scale": 2.0**16}, "fp32": {}}[precision]
    config = tiny_config(
        corpus,
        train_iters=iters,
        micro_batch_size=micro_batch,
        global_batch_size=micro_batch,
        vocab_size=VOCAB,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        eval_interval=10**6,
        eval_iters=1,
        log_interval=max(1, iters // 4),
        num_workers=2,
        lr=3e-4,
        min_lr=3e-5,
        max_position_embeddings=shape["seq_length"],
        split="100,0,0",
        **shape,
        **extra,
    )
    trainer = Trainer(config, build_parallel_grid())
    data_iter = trainer.loader(trainer.train_data, 0)
    warmup = 3
    for _ in range(warmup):
        trainer.train_step(data_iter)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters - warmup):
        loss = trainer.train_step(data_iter)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / (iters - warmup)
    tokens = micro_batch * shape["seq_length"]
    flops = trainer.model_config.flops_per_token(shape["seq_length"]) * tokens / seconds
    return {
        "precision": precision,
        "iteration_ms": 1000 * seconds,
        "tokens_per_s": tokens / seconds,
        "tflops": flops / 1e12,
        "mfu": flops / 1e12 / peak_tflops,
        "final_loss": float(loss),
        "skipped_steps": trainer.engine.skipped_steps,
        "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp16"])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16/fp16 peak; H100/H200 SXM: 989")
    parser.add_argument("--output", default="benchmarks/results/gpu_train.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: no CUDA GPU here; run this on a GPU machine (benchmarks/gpu_check.sh)")
    with tempfile.TemporaryDirectory() as folder:
        corpus = write_corpus(Path(folder), documents=2000, vocab=VOCAB, length=3000)
        rows = [
            run(corpus, p, args.iters, args.micro_batch_size, MODEL_125M, args.peak_tflops) for p in args.precisions
        ]
    print(f"{'precision':9} {'ms/iter':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'skipped':>7} {'GiB':>6}")
    for r in rows:
        print(
            f"{r['precision']:9} {r['iteration_ms']:8.1f} {r['tokens_per_s']:10.0f} {r['tflops']:8.1f} "
            f"{r['mfu']:6.1%} {r['skipped_steps']:7d} {r['max_memory_gib']:6.1f}"
        )
    report = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "model": MODEL_125M,
        "micro_batch_size": args.micro_batch_size,
        "rows": rows,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
