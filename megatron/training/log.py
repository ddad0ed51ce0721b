"""What a training run shows: Megatron-style log lines on stdout and the same scalars in
TensorBoard (written by the first rank only)."""

import math
import time
from typing import Any

from megatron.training.moe_monitor import LayerLoad

LINE = "-" * 100
PROGRESS_SECONDS = 30.0  # long work (evaluation, slow iterations) says how far it got at least this often


class TrainingLogger:
    def __init__(self, tensorboard_dir: str | None, enabled: bool) -> None:
        self.enabled = enabled
        self.writer = None
        if enabled and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=tensorboard_dir, max_queue=100)
        self.last_output = time.monotonic()

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)
            self.last_output = time.monotonic()

    def progress(self, what: str, done: int, total: int) -> None:
        """A line about work in progress, only when nothing was printed for PROGRESS_SECONDS."""
        if time.monotonic() - self.last_output >= PROGRESS_SECONDS:
            self.info(f" > {what}: {done}/{total}")

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
        if stats.get("moe_loss") is not None:
            fields.append(f"moe loss: {stats['moe_loss']:.6E}")
        if stats.get("kd_loss") is not None:
            fields.append(f"kd loss: {stats['kd_loss']:.6E}")
        if stats.get("loss_scale") is not None:
            fields.append(f"loss scale: {stats['loss_scale']:.1f}")
        fields += [
            f"grad norm: {stats['grad_norm']:.3f}",
            f"number of skipped iterations: {stats['skipped']:3d}",
            f"tokens per second: {stats['tokens_per_second']:.1f}",
            f"TFLOP/s: {stats['tflops']:.3f}",
        ]
        self.info(" | ".join(fields) + " |")
        self.scalars(
            iteration,
            {
                "learning-rate": stats["lr"],
                "lm loss": stats["lm_loss"],
                "grad-norm": stats["grad_norm"],
                "iteration-time": stats["iteration_ms"] / 1000.0,
                "tokens-per-second": stats["tokens_per_second"],
                "tflops": stats["tflops"],
                "batch-size": stats["global_batch_size"],
                "skipped-iterations": stats["skipped"],
                "skipped-iterations-total": stats["skipped_total"],
                **({"loss-scale": stats["loss_scale"]} if stats.get("loss_scale") is not None else {}),
                **({"moe loss": stats["moe_loss"]} if stats.get("moe_loss") is not None else {}),
                **({"kd loss": stats["kd_loss"]} if stats.get("kd_loss") is not None else {}),
            },
        )

    def moe_lines(self, iteration: int, loads: list[LayerLoad]) -> None:
        """Expert load per MoE layer: one summary line, scalars and a tokens-per-expert histogram."""
        if not loads:
            return
        self.info(
            " moe | "
            + " | ".join(
                f"layer {load.layer}: imbalance {load.imbalance:.2f} dropped {100 * load.dropped_fraction:.1f}% "
                f"entropy {load.router_entropy:.2f}"
                for load in loads
            )
            + " |"
        )
        for load in loads:
            prefix = f"moe/layer{load.layer}"
            self.scalars(
                iteration,
                {
                    f"{prefix}/imbalance": load.imbalance,
                    f"{prefix}/dropped-fraction": load.dropped_fraction,
                    f"{prefix}/router-entropy": load.router_entropy,
                },
            )
            if self.writer is not None:
                counts = load.tokens_per_expert
                self.writer.add_histogram_raw(
                    f"{prefix}/tokens-per-expert",
                    min=0,
                    max=len(counts) - 1,
                    num=sum(counts),
                    sum=float(sum(e * c for e, c in enumerate(counts))),
                    sum_squares=float(sum(e * e * c for e, c in enumerate(counts))),
                    bucket_limits=[e + 0.5 for e in range(len(counts))],
                    bucket_counts=counts,
                    global_step=iteration,
                )

    def evaluation_line(self, label: str, iteration: int, loss: float) -> None:
        ppl = math.exp(min(20.0, loss))
        self.info(LINE)
        self.info(f" {label} loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |")
        self.info(LINE)
        self.scalars(iteration, {f"lm loss {label}": loss, f"lm loss {label} ppl": ppl})

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
