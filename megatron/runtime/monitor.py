"""What the engine reports by itself, as DeepSpeed's engine does: a progress line every
`steps_per_print` optimizer steps (with forward / backward / step times when
`wall_clock_breakdown`), a line for every skipped step, and TensorBoard scalars by samples seen
(`tensorboard.enabled`). Only the first rank reports."""

import time
from pathlib import Path

import torch

from megatron.runtime.config.schema import RuntimeConfig

PHASES = ("forward", "backward", "step")


class EngineMonitor:
    def __init__(self, config: RuntimeConfig, is_first_rank: bool, device: torch.device) -> None:
        self.enabled = is_first_rank
        self.steps_per_print = config.steps_per_print
        self.wall_clock = config.wall_clock_breakdown
        self.device = device
        self.samples_per_step = config.train_batch_size or 0
        self.elapsed_s = dict.fromkeys(PHASES, 0.0)
        self.started: dict[str, float] = {}
        self.losses: list[float] = []
        self.writer = None
        if is_first_rank and config.tensorboard.enabled:
            from torch.utils.tensorboard import SummaryWriter

            folder = Path(config.tensorboard.output_path or "runs") / config.tensorboard.job_name
            self.writer = SummaryWriter(log_dir=str(folder))

    def start(self, phase: str) -> None:
        if self.wall_clock:
            self._sync()
            self.started[phase] = time.perf_counter()

    def stop(self, phase: str) -> None:
        if self.wall_clock and phase in self.started:
            self._sync()
            self.elapsed_s[phase] += time.perf_counter() - self.started.pop(phase)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def record_loss(self, loss: torch.Tensor) -> None:
        if self.writer is not None:
            self.losses.append(float(loss.detach()))

    def skipped(self, step: int, reason: str) -> None:
        if self.enabled:
            print(f"[engine] step {step}: {reason}; skipping this optimizer step", flush=True)

    def after_step(self, step: int, skipped: int, lrs: list[float], loss_scale: float) -> None:
        """Called after every optimizer step (taken or skipped), `step` counting from 1."""
        samples = step * self.samples_per_step
        if self.writer is not None:
            if self.losses:
                self.writer.add_scalar("Train/Samples/train_loss", sum(self.losses) / len(self.losses), samples)
            self.writer.add_scalar("Train/Samples/lr", lrs[0], samples)
            self.writer.add_scalar("Train/Samples/loss_scale", loss_scale, samples)
            self.writer.flush()  # the engine has no end: a run may stop after any step
            self.losses.clear()
        if not self.enabled or self.steps_per_print <= 0 or step % self.steps_per_print:
            return
        line = f"[engine] step={step}, skipped={skipped}, lr={[f'{lr:.4e}' for lr in lrs]}, loss_scale={loss_scale:g}"
        if self.wall_clock:
            per_step = {phase: 1000 * total / self.steps_per_print for phase, total in self.elapsed_s.items()}
            line += " | ms per step: " + ", ".join(f"{phase} {ms:.1f}" for phase, ms in per_step.items())
            self.elapsed_s = dict.fromkeys(PHASES, 0.0)
        print(line, flush=True)
