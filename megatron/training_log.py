"""What a training run shows: Megatron-style log lines on stdout and the same scalars in
TensorBoard (written by the first rank only)."""

import math
from typing import Any

LINE = "-" * 100


class TrainingLogger:
    def __init__(self, tensorboard_dir: str | None, enabled: bool) -> None:
        self.enabled = enabled
        self.writer = None
        if enabled and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=tensorboard_dir, max_queue=100)

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def scalars(self, iteration: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, iteration)

    def training_line(self, iteration: int, train_iters: int, stats: dict[str, Any]) -> None:
        fields = [
            f" iteration {iteration:8d}/{train_iters:8d}",
            f"consumed samples: {stats['consumed_samples']:12d}",
            f"consumed tokens: {stats['consumed_tokens']:14d}",
            f"elapsed time per iteration (ms): {stats['iteration_ms']:.1f}",
            f"learning rate: {stats['lr']:.3E}",
            f"global batch size: {stats['global_batch_size']:5d}",
            f"lm loss: {stats['lm_loss']:.6E}",
        ]
        if stats.get("loss_scale") is not None:
            fields.append(f"loss scale: {stats['loss_scale']:.1f}")
        fields += [
            f"grad norm: {stats['grad_norm']:.3f}",
            f"number of skipped iterations: {stats['skipped']:3d}",
            f"tokens per second: {stats['tokens_per_second']:.1f}",
            f"TFLOP/s: {stats['tflops']:.3f}",
        ]
        self.info(" | ".join(fields) + " |")
        self.scalars(iteration, {
            "learning-rate": stats["lr"], "lm loss": stats["lm_loss"], "grad-norm": stats["grad_norm"],
            "iteration-time": stats["iteration_ms"] / 1000.0, "tokens-per-second": stats["tokens_per_second"],
            "tflops": stats["tflops"], "batch-size": stats["global_batch_size"],
            **({"loss-scale": stats["loss_scale"]} if stats.get("loss_scale") is not None else {}),
        })

    def evaluation_line(self, label: str, iteration: int, loss: float) -> None:
        ppl = math.exp(min(20.0, loss))
        self.info(LINE)
        self.info(f" {label} loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |")
        self.info(LINE)
        self.scalars(iteration, {f"lm loss {label}": loss, f"lm loss {label} ppl": ppl})

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
