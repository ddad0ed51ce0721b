"""What a training run shows: Megatron-style log lines on stdout and the same scalars in
TensorBoard (written by the first rank only)."""

import math
import time
from dataclasses import dataclass, field

import torch

from megatron.checkpoint.manifest import LogWindowRecord
from megatron.comm.comms_log import OpTotal
from megatron.timers import TimerReading
from megatron.training.losses import Losses
from megatron.training.moe_monitor import LayerLoad

LINE = "-" * 100
PROGRESS_SECONDS = 30.0  # long work (evaluation, slow iterations) says how far it got at least this often


@dataclass
class LogWindow:
    """The iterations since the last training line: this rank's loss terms of each and how many
    of them skipped their step. A checkpoint saved between two lines carries it (every
    rank's, in its manifest), so that the first line after a resume averages the same
    iterations as the uninterrupted run's line does, to the last bit."""

    losses: list[Losses] = field(default_factory=list)
    skipped: int = 0
    carried: int = 0  # how many came from the checkpoint: not timed here, not in this run's losses

    def record(self, every_rank: list[list[list[float]]]) -> LogWindowRecord:
        """What the checkpoint keeps: `every_rank[r]` is rank r's `as_lists()` (terms in `Losses` order)."""
        return LogWindowRecord(losses=every_rank, skipped=self.skipped)

    def stacked(self) -> Losses:
        """Each term of every iteration in the window, as a tensor [iterations]."""
        return Losses.from_vector(torch.stack([losses.vector() for losses in self.losses]))

    def as_lists(self) -> list[list[float]]:
        return self.stacked().vector().tolist() if self.losses else []

    @classmethod
    def from_record(
        cls, saved: LogWindowRecord | None, rank: int, world_size: int, device: torch.device
    ) -> "LogWindow":
        """This rank's window from a checkpoint's record; an empty one from a checkpoint without
        it (saved at a line, or by an earlier version). Resumed with another world size, every
        rank takes the mean over the saved ranks: the same iterations, to rounding."""
        if saved is None or not saved.losses or not saved.losses[0]:
            return cls()
        ranks = torch.tensor(saved.losses, dtype=torch.float32, device=device)  # [ranks, iterations, terms]
        mine = ranks[rank] if len(ranks) == world_size else ranks.mean(0)
        return cls([Losses.from_vector(terms) for terms in mine.unbind(0)], saved.skipped, carried=len(mine))


@dataclass(frozen=True)
class IntervalStats:
    """What a training line reports about the iterations since the previous one (losses: means
    over them and the data-parallel ranks; None where the run has no such term)."""

    consumed_samples: int
    consumed_tokens: int
    iteration_ms: float
    lr: float
    global_batch_size: int
    lm_loss: float
    moe_loss: float | None
    kd_loss: float | None
    loss_scale: float | None  # fp16 only
    grad_norm: float
    skipped: int  # iterations in the interval that skipped their step
    skipped_total: int
    tokens_per_second: float
    tflops: float  # per rank
    mfu: float  # tflops / the device's peak (megatron/profiling/peak_flops.py)


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

    def training_line(self, iteration: int, train_iters: int, stats: "IntervalStats") -> None:
        fields = [
            f" iteration {iteration:8d}/{train_iters:8d}",
            f"consumed samples: {stats.consumed_samples:12d}",
            f"consumed tokens: {stats.consumed_tokens:14d}",
            f"elapsed time per iteration (ms): {stats.iteration_ms:.1f}",
            f"learning rate: {stats.lr:.3E}",
            f"global batch size: {stats.global_batch_size:5d}",
            f"lm loss: {stats.lm_loss:.6E}",
        ]
        if stats.moe_loss is not None:
            fields.append(f"moe loss: {stats.moe_loss:.6E}")
        if stats.kd_loss is not None:
            fields.append(f"kd loss: {stats.kd_loss:.6E}")
        if stats.loss_scale is not None:
            fields.append(f"loss scale: {stats.loss_scale:.1f}")
        fields += [
            f"grad norm: {stats.grad_norm:.3f}",
            f"number of skipped iterations: {stats.skipped:3d}",
            f"tokens per second: {stats.tokens_per_second:.1f}",
            f"TFLOP/s: {stats.tflops:.3f}",
            f"MFU: {100 * stats.mfu:.1f}%",
        ]
        self.info(" | ".join(fields) + " |")
        optional = {"loss-scale": stats.loss_scale, "moe loss": stats.moe_loss, "kd loss": stats.kd_loss}
        self.scalars(
            iteration,
            {
                "learning-rate": stats.lr,
                "lm loss": stats.lm_loss,
                "grad-norm": stats.grad_norm,
                "iteration-time": stats.iteration_ms / 1000.0,
                "tokens-per-second": stats.tokens_per_second,
                "tflops": stats.tflops,
                "mfu": stats.mfu,
                "batch-size": stats.global_batch_size,
                "skipped-iterations": stats.skipped,
                "skipped-iterations-total": stats.skipped_total,
                **{name: value for name, value in optional.items() if value is not None},
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

    def timer_lines(self, iteration: int, text: str, readings: list[TimerReading], to_tensorboard: bool) -> None:
        """Megatron's timer block after the training line; with --log-timers-to-tensorboard each
        timer's max across ranks as `<name>-time` (seconds per iteration)."""
        if readings:
            self.info(text)
        if to_tensorboard:
            self.scalars(iteration, {f"{reading.name}-time": reading.max_ms / 1000.0 for reading in readings})

    def comms_totals(self, iteration: int, totals: list[OpTotal]) -> None:
        """The communication log's per-op totals since the run began, as TensorBoard scalars."""
        for total in totals:
            self.scalars(
                iteration,
                {
                    f"comms/{total.op}/count": total.count,
                    f"comms/{total.op}/megabytes": total.bytes / 1e6,
                    f"comms/{total.op}/latency-ms": 1000 * total.total_s,
                },
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
