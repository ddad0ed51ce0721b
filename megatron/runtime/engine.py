"""The training engine: micro-batches, loss scaling, data-parallel gradient reduction, clipping,
the optimizer step and the LR schedule, for any torch.nn.Module.

Gradients are accumulated unscaled by the number of micro-batches; at the boundary one pass
folds the data-parallel average, the accumulation average, the loss-scale removal and the
clipping coefficient into a single multiply, so the step costs what a bare loop's step costs.
"""

import json
import math
import os
import shutil
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron.parallel import ParallelGrid
from megatron.runtime.config import RuntimeConfig, load_runtime_config
from megatron.runtime.loss_scaler import DynamicLossScaler, StaticLossScaler
from megatron.errors import CheckpointError
from megatron.runtime.state_io import (
    load_optimizer_state, load_rng_state, load_tensors, optimizer_state, save_rng_state, save_tensors,
)


def build_optimizer(model: nn.Module, config: RuntimeConfig) -> torch.optim.Optimizer:
    """Adam(W) with weight decay on matrices only: biases and norm weights are not decayed."""
    params = dict(config.optimizer.params)
    weight_decay = params.pop("weight_decay", 0.0)
    adam_w_mode = params.pop("adam_w_mode", True)
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trainable if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer_class = torch.optim.AdamW if config.optimizer.type == "AdamW" or adam_w_mode else torch.optim.Adam
    return optimizer_class([g for g in groups if g["params"]], fused=True, **params)


def build_loss_scaler(config: RuntimeConfig) -> DynamicLossScaler | StaticLossScaler:
    fp16 = config.fp16
    if not fp16.enabled:
        return StaticLossScaler(1.0)
    if fp16.loss_scale > 0:
        return StaticLossScaler(fp16.loss_scale)
    return DynamicLossScaler(
        init_scale=2.0**fp16.initial_scale_power, scale_window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis, consecutive_hysteresis=fp16.consecutive_hysteresis,
        min_scale=fp16.min_loss_scale,
    )


class Engine:
    def __init__(
        self,
        model: nn.Module,
        config: RuntimeConfig,
        parallel: ParallelGrid,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
    ) -> None:
        self.module = model.to(parallel.device)
        self.config = config
        self.parallel = parallel
        self.optimizer = optimizer or build_optimizer(self.module, config)
        self.lr_scheduler = lr_scheduler
        self.loss_scaler = build_loss_scaler(config)
        self.gradient_accumulation_steps = config.gradient_accumulation_steps or 1
        self.autocast_dtype = torch.bfloat16 if config.bf16.enabled else torch.float16 if config.fp16.enabled else None
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.param_names = {p: n for n, p in self.module.named_parameters()}
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False
        self._broadcast_parameters()

    def _broadcast_parameters(self) -> None:
        """Every data-parallel rank starts from rank 0's weights."""
        if self.parallel.dp_size > 1:
            for tensor in self.module.state_dict().values():
                dist.broadcast(tensor, src=dist.get_global_rank(self.parallel.dp_group, 0), group=self.parallel.dp_group)

    def autocast(self) -> Any:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.parallel.device.type, dtype=self.autocast_dtype)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.autocast():
            return self.module(*args, **kwargs)

    __call__ = forward

    def backward(self, loss: torch.Tensor) -> None:
        scale = self.loss_scaler.scale
        (loss * scale if scale != 1.0 else loss).backward()

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def _reduce_gradients(self, grads: list[torch.Tensor]) -> None:
        """Sum gradients over the data-parallel group, one flat buffer per dtype."""
        if self.parallel.dp_size == 1:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in grads:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for same_dtype in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in same_dtype])
            dist.all_reduce(flat, group=self.parallel.dp_group)
            torch._foreach_copy_(same_dtype, [t.view_as(g) for t, g in zip(flat.split([g.numel() for g in same_dtype]), same_dtype)])

    def step(self) -> None:
        """Count a micro-batch; at the accumulation boundary reduce, clip and update."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        grads = [p.grad for p in self.params]
        self._reduce_gradients(grads)
        divisor = self.loss_scaler.scale * self.gradient_accumulation_steps * self.parallel.dp_size
        grad_norm = float(torch.nn.utils.get_total_norm(grads, foreach=True)) / divisor
        self.last_grad_norm = grad_norm
        self.last_step_skipped = not math.isfinite(grad_norm)
        if self.last_step_skipped:
            self.skipped_steps += 1
        else:
            coeff = 1.0 / divisor
            clip = self.config.gradient_clipping
            if clip > 0 and grad_norm > clip:
                coeff *= clip / (grad_norm + 1e-6)
            torch._foreach_mul_(grads, coeff)
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.loss_scaler.update(self.last_step_skipped)
        self.optimizer.zero_grad(set_to_none=True)
        self.global_steps += 1

    def save_checkpoint(self, save_dir: str | Path, tag: str, client_state: dict[str, Any] | None = None) -> Path:
        """Write `save_dir/tag/` atomically: everything goes to `tag.tmp` first, then is renamed,
        so a crash mid-save leaves any earlier checkpoint untouched."""
        final = Path(save_dir) / tag
        staging = final.with_name(tag + ".tmp")
        if self.parallel.is_first_rank:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        self.parallel.barrier()
        save_rng_state(staging / f"rng_rank{self.parallel.rank:05d}.safetensors")
        if self.parallel.is_first_rank:
            save_tensors(staging / "model.safetensors", self.module.state_dict())
            optim_tensors, optim_meta = optimizer_state(self.optimizer, self.param_names)
            save_tensors(staging / "optimizer.safetensors", optim_tensors)
            meta = {
                "global_steps": self.global_steps, "micro_steps": self.micro_steps,
                "skipped_steps": self.skipped_steps, "optimizer": optim_meta,
                "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                "loss_scaler": self.loss_scaler.state_dict(), "client_state": client_state or {},
                "dp_size": self.parallel.dp_size,
            }
            (staging / "engine.json").write_text(json.dumps(meta, indent=1))
        self.parallel.barrier()
        if self.parallel.is_first_rank:
            old = final.with_name(tag + ".old")
            if final.exists():
                os.replace(final, old)
            os.replace(staging, final)
            shutil.rmtree(old, ignore_errors=True)
        self.parallel.barrier()
        return final

    def load_checkpoint(
        self, load_dir: str | Path, tag: str, load_optimizer: bool = True, load_rng: bool = True
    ) -> dict[str, Any]:
        """Restore model (and optimizer, schedule, loss scale, RNG); returns the client state."""
        folder = Path(load_dir) / tag
        meta_path = folder / "engine.json"
        if not meta_path.is_file():
            raise CheckpointError(f"no checkpoint at {folder} (engine.json is missing); check --load and the tag")
        meta = json.loads(meta_path.read_text())
        self._load_model(load_tensors(folder / "model.safetensors"), folder)
        if load_optimizer:
            load_optimizer_state(self.optimizer, self.param_names, load_tensors(folder / "optimizer.safetensors"), meta["optimizer"])
            if self.lr_scheduler is not None and meta["lr_scheduler"] is not None:
                self.lr_scheduler.load_state_dict(meta["lr_scheduler"])
            self.loss_scaler.load_state_dict(meta["loss_scaler"])
            self.global_steps, self.micro_steps = meta["global_steps"], meta["micro_steps"]
            self.skipped_steps = meta["skipped_steps"]
        rng_path = folder / f"rng_rank{self.parallel.rank:05d}.safetensors"
        if load_rng and rng_path.is_file():
            load_rng_state(rng_path)
        return meta["client_state"]

    def _load_model(self, tensors: dict[str, torch.Tensor], folder: Path) -> None:
        own = self.module.state_dict()
        missing = sorted(set(own) - set(tensors))
        unexpected = sorted(set(tensors) - set(own))
        if missing or unexpected:
            raise CheckpointError(
                f"the model in {folder} does not match this model (missing {missing[:3]}, unexpected "
                f"{unexpected[:3]}); use the same model flags as the run that saved it"
            )
        for name, tensor in tensors.items():
            if tensor.shape != own[name].shape:
                raise CheckpointError(
                    f"parameter {name} in {folder} has shape {tuple(tensor.shape)} but this model's is "
                    f"{tuple(own[name].shape)}; use the same model flags as the run that saved it"
                )
        self.module.load_state_dict(tensors)


def initialize(
    model: nn.Module,
    config: dict[str, Any] | str | Path | RuntimeConfig,
    parallel: ParallelGrid,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
) -> Engine:
    """DeepSpeed-style entry point: validate the config and wrap the model in an engine."""
    if not isinstance(config, RuntimeConfig):
        config = load_runtime_config(config, parallel.dp_size)
    return Engine(model, config, parallel, optimizer=optimizer, lr_scheduler=lr_scheduler)
