"""The training engine: micro-batches, loss scaling, data-parallel gradient reduction, clipping,
the optimizer step and the LR schedule, for any torch.nn.Module.

Gradients are accumulated unscaled by the number of micro-batches; at the boundary one pass
folds the data-parallel average, the accumulation average, the loss-scale removal and the
clipping coefficient into a single multiply, so the step costs what a bare loop's step costs.
Everything that depends on the ZeRO stage goes through one strategy object (megatron/runtime/
strategy.py): replicated at stage 0; at stages 1-3 the optimizer updates this rank's flat fp32
shards (megatron/runtime/zero/) and the updated shards are gathered back into the model's
parameters (stage 3: when next used).
"""

import functools
import math
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron import comm
from megatron.checkpoint.aio_writer import AioWriter
from megatron.checkpoint.manifest import Manifest, RunRecord
from megatron.checkpoint.save import EngineState, save_folder
from megatron.checkpoint.verify import read_checkpoint, verify_folder
from megatron.comm import CommsLog
from megatron.errors import ConfigError
from megatron.parallel import ParallelGrid, all_reduce, is_parallel
from megatron.placement import pipeline_shared, placement_of
from megatron.runtime import engine_checkpoint
from megatron.runtime.config.combinations import refuse_contradictions
from megatron.runtime.config.deepspeed_keys import no_effect_notes
from megatron.runtime.config.schema import RuntimeConfig, load_runtime_config
from megatron.runtime.engine_checks import check_engine_inputs, check_pipeline_sharing
from megatron.runtime.grad_norm import global_sq_norm
from megatron.runtime.gradient_averaging import gradient_averaging
from megatron.runtime.loss_scaler import build_loss_scaler
from megatron.runtime.lr_schedules import build_scheduler
from megatron.runtime.monitor import EngineMonitor
from megatron.runtime.nonfinite import NonFiniteStep, nonfinite_ranks
from megatron.runtime.optim.compressed import CompressedOptimizer
from megatron.runtime.optimizer_factory import build_optimizer
from megatron.runtime.profiled_step import ProfiledStep
from megatron.runtime.replicated import Replicated
from megatron.runtime.strategy import build_strategy
from megatron.runtime.swap.swapped_adam import SwappedAdam
from megatron.timers import timed

NOT_RECORDING = nullcontext()


def _records_comms(method: Callable[..., Any]) -> Callable[..., Any]:
    """The engine method with its ops going to the engine's communication log."""

    @functools.wraps(method)
    def recorded(self: "Engine", *args: Any, **kwargs: Any) -> Any:
        with self.comms_recording():
            return method(self, *args, **kwargs)

    return recorded


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
        self.optimizer = optimizer or build_optimizer(self.module, config, rank=parallel.rank, grid=parallel)
        check_engine_inputs(config, self.optimizer, lr_scheduler, parallel.device)
        if config.scheduler is not None:
            lr_scheduler = build_scheduler(self.optimizer, config.scheduler.type, config.scheduler.params)
        self.lr_scheduler = lr_scheduler
        self.loss_scaler = build_loss_scaler(config)
        # the division before the all-reduce rides on backward's loss multiplier, as the loss
        # scale does; the rest folds into the step's single multiply
        self.grad_predivisor, self.grad_postdivisor = gradient_averaging(config, parallel.dp_size)
        self.gradient_accumulation_steps = config.gradient_accumulation_steps or 1
        self.autocast_dtype = torch.bfloat16 if config.bf16.enabled else torch.float16 if config.fp16.enabled else None
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False
        self.consecutive_skipped_steps = 0
        self.last_nonfinite: NonFiniteStep | None = None  # which ranks saw what, when the last step was skipped
        self._loss_nonfinite = torch.zeros((), dtype=torch.bool, device=parallel.device)  # no sync per micro-batch
        self.monitor = EngineMonitor(config, parallel.is_first_rank, parallel.device)
        logged = config.comms_logger
        self.comms_log = (
            CommsLog(
                logged.prof_all,
                tuple(logged.prof_ops),
                logged.verbose,
                logged.debug,
                prints=parallel.is_first_rank,
                device=parallel.device,
            )
            if logged.enabled
            else None
        )
        if parallel.is_first_rank:
            for line in no_effect_notes(config):
                print(line, flush=True)
        with self.comms_recording():
            self._broadcast_parameters()
        self.pipeline_shared = pipeline_shared(self.module)
        check_pipeline_sharing(config, self.pipeline_shared)
        self.strategy = build_strategy(self.module, self.optimizer, config, parallel)
        if isinstance(self.optimizer, SwappedAdam):  # swap files for the shards the groups hold now
            self.optimizer.prepare(self.strategy.swapped_stores())
        profiling = config.flops_profiler
        self.profiled_step = (
            ProfiledStep(profiling, self.module, self, parallel, config.train_batch_size or 0)
            if profiling.enabled
            else None
        )

    def _broadcast_parameters(self) -> None:
        """Every replica starts from its group's first rank's weights: dense tensors over the
        data-parallel group, experts over their expert-data-parallel group."""
        grid = self.parallel
        for tensor in self.module.state_dict(keep_vars=True).values():
            group = placement_of(tensor).replica_group(grid)
            if is_parallel(group):
                comm.broadcast(tensor.detach(), src=dist.get_global_rank(group, 0), group=group)

    def comms_recording(self) -> AbstractContextManager[Any]:
        """A context in which the ops issued go to the `comms_logger` block's log, if it is on."""
        return NOT_RECORDING if self.comms_log is None else self.comms_log.recording()

    def whole_parameters(self) -> AbstractContextManager[Any]:
        """A context in which every parameter of the model holds its values (ZeRO-3 frees them
        between uses): for saving, loading or inspecting weights outside forward."""
        return self.strategy.full_parameters()

    def autocast(self) -> Any:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.parallel.device.type, dtype=self.autocast_dtype)

    @_records_comms
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.profiled_step is not None:
            self.profiled_step.before_forward(self.global_steps)
        self.monitor.start("forward")
        with timed("forward-compute"), self.autocast(), self.strategy.forward_context():
            output = self.module(*args, **kwargs)
        self.monitor.stop("forward")
        return output

    __call__ = forward

    @_records_comms
    def backward(
        self, loss: torch.Tensor, activation: torch.Tensor | None = None, activation_grad: torch.Tensor | None = None
    ) -> None:
        """Backward from `loss`; on a pipeline stage before the last, also from the `activation` it
        sent on, with the gradient the next stage sent back (already scaled as the loss is)."""
        self.monitor.record_loss(loss)
        self._loss_nonfinite |= ~torch.isfinite(loss.detach()).all()
        self.monitor.start("backward")
        with timed("backward-compute"):
            self._backward(loss, activation, activation_grad)
        self.monitor.stop("backward")

    def _backward(
        self, loss: torch.Tensor, activation: torch.Tensor | None, activation_grad: torch.Tensor | None
    ) -> None:
        scale = self.loss_scaler.scale / self.grad_predivisor
        self.strategy.before_backward(self.is_gradient_accumulation_boundary())
        scaled = loss * scale if scale != 1.0 else loss
        if activation is None:
            scaled.backward()
        else:
            tensors, grads = [activation], [activation_grad]
            if scaled.requires_grad:  # a stage without MoE layers has a constant router loss
                tensors.append(scaled)
                grads.append(None)
            torch.autograd.backward(tensors, grads)
        self.strategy.after_backward()

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    @_records_comms
    def step(self) -> None:
        """Count a micro-batch; at the accumulation boundary reduce, clip and update."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        self.monitor.start("step")
        strategy = self.strategy
        # a compressed optimizer averages tensors of its own instead on some steps (ZeRO stage 0 only:
        # the config checks)
        optimizer = self.optimizer
        local = (
            isinstance(optimizer, CompressedOptimizer)
            and not optimizer.reduces_gradients
            and isinstance(strategy, Replicated)
        )
        with timed("all-grads-sync"):
            for param in self.pipeline_shared:
                all_reduce(param.grad, self.parallel.embedding_group)
            if local:
                dense_grads, expert_grads = strategy.local_gradients()
            else:
                dense_grads, expert_grads = strategy.reduce_gradients()
        with timed("optimizer"):
            self._update(dense_grads, expert_grads, local)
        self.global_steps += 1
        self.monitor.stop("step")
        self.monitor.after_step(self.global_steps, self.skipped_steps, self.get_lr(), self.loss_scaler.scale)
        if self.profiled_step is not None:
            self.profiled_step.after_step(self.global_steps)

    def _update(self, dense_grads: list[torch.Tensor], expert_grads: list[torch.Tensor], local: bool) -> None:
        """Clip and step with the reduced gradients (`local`: each rank's own, which 1-bit Adam's
        momentum averaging then reduces), or skip the step where they are not finite."""
        grads = dense_grads + expert_grads
        # a rank's own gradient is its own mean; an expert's, divided by dp / expert_dp, averages over
        # its expert-data-parallel replicas to the sum over them / dp that reduce_gradients gives
        postdivisor = 1.0 if local else self.grad_postdivisor
        divisor = self.loss_scaler.scale * self.gradient_accumulation_steps * postdivisor
        sq_norm, grads_nonfinite = global_sq_norm(dense_grads, expert_grads, self.strategy, self.parallel)
        grad_norm = math.sqrt(sq_norm) / divisor
        self.last_grad_norm = grad_norm
        self.last_nonfinite = nonfinite_ranks(
            self._loss_nonfinite, grads_nonfinite, math.isfinite(grad_norm), self.parallel
        )
        self.last_step_skipped = self.last_nonfinite is not None
        if self.last_step_skipped:
            self.skipped_steps += 1
            self.consecutive_skipped_steps += 1
            self.monitor.skipped(
                self.global_steps + 1,
                f"gradient overflow at loss scale {self.loss_scaler.scale:g}"
                if self.config.fp16.enabled
                else self.last_nonfinite.describe(),
            )
        else:
            coeff = 1.0 / divisor
            clip = self.config.gradient_clipping
            if clip > 0 and grad_norm > clip:
                coeff *= clip / (grad_norm + 1e-6)
            torch._foreach_mul_(grads, coeff)
            if local and expert_grads:
                grid = self.parallel
                torch._foreach_mul_(expert_grads, grid.expert_dp_size / grid.dp_size)
            self.consecutive_skipped_steps = 0
            self.optimizer.step()
            self.strategy.after_step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.loss_scaler.update(self.last_step_skipped)
        self.optimizer.zero_grad(set_to_none=True)
        self.strategy.zero_gradients()

    @property
    def precision(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.autocast_dtype, "fp32")

    @functools.cached_property
    def checkpoint_writer(self) -> AioWriter | None:
        """The ds_config's fast checkpoint writer (FastPersist), made at the first save: its staging
        buffers are kept for every later one. None: buffered writes."""
        c = self.config.checkpoint
        if not c.fast_writer:
            return None
        assert c.writer is not None
        log = functools.partial(print, flush=True) if self.parallel.is_first_rank else lambda line: None
        return AioWriter(self.config.aio.handle_settings(), c.writer.io_buffer_size, c.writer.io_buffer_double, log)

    def checkpoint_state(self, client_state: dict[str, Any] | None = None) -> EngineState:
        """This rank's share of a checkpoint (engine_checkpoint.py)."""
        return engine_checkpoint.checkpoint_state(self, client_state)

    def save_checkpoint(
        self,
        save_dir: str | Path,
        tag: str,
        client_state: dict[str, Any] | None = None,
        run: RunRecord | None = None,
    ) -> Path:
        """Write `save_dir/tag/` with its manifest, atomically (megatron/checkpoint/save.py): a crash
        mid-save leaves any earlier checkpoint untouched."""
        return save_folder(self.checkpoint_state(client_state), Path(save_dir) / tag, run)

    def save_16bit_model(self, save_dir: str | Path, save_filename: str = "model.safetensors") -> bool:
        """DeepSpeed's consolidated 16-bit weights in one safetensors file (engine_checkpoint.py)."""
        return engine_checkpoint.save_16bit_model(self, save_dir, save_filename)

    def load_checkpoint(
        self,
        load_dir: str | Path,
        tag: str,
        load_optimizer: bool = True,
        load_rng: bool = True,
        verify: bool = True,
        manifest: Manifest | None = None,
    ) -> dict[str, Any]:
        """Restore model (and optimizer, schedule, loss scale, RNG) after checking every file
        against the manifest (`verify=False` to skip that; `manifest`: the folder's, which the caller
        has read and verified); returns the client state that save_checkpoint was given."""
        folder = Path(load_dir) / tag
        if manifest is None:
            manifest = verify_folder(folder, self.parallel) if verify else read_checkpoint(folder)
        engine_checkpoint.restore(self, folder, manifest.engine, load_optimizer, load_rng)
        return manifest.engine.client_state


def initialize(
    model: nn.Module,
    config: dict[str, Any] | str | Path | RuntimeConfig,
    parallel: ParallelGrid,
    optimizer: torch.optim.Optimizer | Callable[[Iterable[Any]], torch.optim.Optimizer] | None = None,
    lr_scheduler: Any = None,
    model_parameters: Iterable[Any] | None = None,
) -> Engine:
    """DeepSpeed-style entry point: validate the config and wrap the model in an engine. The
    optimizer, as DeepSpeed takes it: an optimizer (then `model_parameters` are not needed), a
    callable that builds one from `model_parameters`, or None for the config's, built over
    `model_parameters` (default: the model's)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"initialize() needs the model as a torch.nn.Module, not {type(model).__name__}")
    if isinstance(config, RuntimeConfig):
        refuse_contradictions(config)  # a config read from a dict or file was checked as it was read
    else:
        config = load_runtime_config(config, parallel.dp_size)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(model.parameters() if model_parameters is None else model_parameters)
    if optimizer is None:
        optimizer = build_optimizer(model, config, model_parameters, parallel.rank, parallel)
    return Engine(model, config, parallel, optimizer=optimizer, lr_scheduler=lr_scheduler)
