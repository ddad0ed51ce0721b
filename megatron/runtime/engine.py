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

import math
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron.checkpoint.layout import ENGINE_FILE, MODEL, OPTIMIZER, RNG, rank_file
from megatron.checkpoint.manifest import RunRecord
from megatron.checkpoint.save import EngineState, save_folder
from megatron.checkpoint.tensors import (
    ShardedReader,
    expert_ids,
    load_model_entries,
    load_rng_state,
    model_entries,
    optimizer_groups,
    save_tensors,
    tensor_parallel_splits,
)
from megatron.checkpoint.verify import DamagedCheckpoint, read_engine_meta, verify_folder
from megatron.errors import ConfigError
from megatron.parallel import ParallelGrid, all_reduce, is_parallel
from megatron.runtime.config.deepspeed_keys import no_effect_notes
from megatron.runtime.config.schema import RuntimeConfig, load_runtime_config
from megatron.runtime.gradient_kinds import SLICE, WHOLE, pipeline_shared
from megatron.runtime.loss_scaler import DynamicLossScaler, StaticLossScaler
from megatron.runtime.lr_schedules import build_scheduler
from megatron.runtime.monitor import EngineMonitor
from megatron.runtime.optim.cpu_adam import CPUAdam
from megatron.runtime.optim.lamb import Lamb
from megatron.runtime.schedule_resume import restore_schedule
from megatron.runtime.strategy import build_strategy
from megatron.runtime.swap.swapped_adam import SwappedAdam


def build_optimizer(
    model: nn.Module,
    config: RuntimeConfig,
    model_parameters: Iterable[Any] | None = None,
    rank: int = 0,
) -> torch.optim.Optimizer:
    """The config's optimizer over `model_parameters` as DeepSpeed builds it: groups of parameters
    kept as given, or a list of parameters as one group. Without them: the model's trainable
    parameters with weight decay on matrices only (biases and norm weights are not decayed)."""
    params = config.optimizer.params.given()  # the optimizer's own defaults are DeepSpeed's
    weight_decay = params.pop("weight_decay", 0.0)
    adam_w_mode = params.pop("adam_w_mode", True)
    given = list(model_parameters) if model_parameters is not None else []
    if given and not isinstance(given[0], dict):
        given = [{"params": given}]
    if given:
        groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in given]
        groups = [{"weight_decay": weight_decay, **g} for g in groups]
    else:
        trainable = [p for p in model.parameters() if p.requires_grad]
        # a stacked expert tensor has one leading dimension more than the tensor of one expert
        is_matrix = {p: p.dim() - (expert_ids(p) is not None) >= 2 for p in trainable}
        groups = [
            {"params": [p for p in trainable if is_matrix[p]], "weight_decay": weight_decay},
            {"params": [p for p in trainable if not is_matrix[p]], "weight_decay": 0.0},
        ]
    groups = [g for g in groups if g["params"]]
    kind = config.optimizer.type
    if kind == "Lamb" and config.zero_optimization.stage:
        raise ConfigError(
            "optimizer Lamb needs whole tensors for its per-tensor trust ratio, but ZeRO hands the optimizer "
            "flat shards; use Adam/AdamW with ZeRO, or zero_optimization.stage 0 with Lamb"
        )
    offload = config.zero_optimization.offload_optimizer
    try:
        if kind == "Lamb":
            return Lamb(groups, **params)
        if offload.device != "none":
            if next(model.parameters()).device.type != "cpu":
                raise ConfigError(
                    f"offload_optimizer to {offload.device} is implemented for CPU training only so far; "
                    'set offload_optimizer.device to "none" on an accelerator'
                )
            adam = {**params, "adamw_mode": kind == "AdamW" or adam_w_mode}
            if offload.device == "cpu":
                return CPUAdam(groups, **adam)
            return SwappedAdam(groups, offload, config.aio, config.zero_optimization.sub_group_size, rank, **adam)
        if not params.pop("bias_correction", True):
            raise ConfigError(
                "optimizer.params.bias_correction false is implemented by the offloaded CPU Adam and "
                "by Lamb only; drop it, or set zero_optimization.offload_optimizer"
            )
        optimizer_class = torch.optim.AdamW if kind == "AdamW" or adam_w_mode else torch.optim.Adam
        return optimizer_class(groups, fused=True, **params)
    except (TypeError, NotImplementedError) as error:
        raise ConfigError(
            f"bad optimizer.params for {kind}: {error}; use the parameter names of DeepSpeed's {kind}"
        ) from None


@dataclass(frozen=True)
class NonFiniteStep:
    """An optimizer step whose loss or gradients held a NaN or an infinity, and on which ranks."""

    loss_ranks: list[int]
    grad_ranks: list[int]

    def describe(self) -> str:
        parts = [
            f"the {what} is not finite on rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"
            for what, ranks in (("loss", self.loss_ranks), ("gradient norm", self.grad_ranks))
            if ranks
        ]
        return " and ".join(parts)


def build_loss_scaler(config: RuntimeConfig) -> DynamicLossScaler | StaticLossScaler:
    fp16 = config.fp16
    if not fp16.enabled:
        return StaticLossScaler(1.0)
    if fp16.loss_scale > 0:
        return StaticLossScaler(fp16.loss_scale)
    return DynamicLossScaler(
        init_scale=2.0**fp16.initial_scale_power,
        scale_window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
        min_scale=fp16.min_loss_scale,
    )


def _same_setting(a: Any, b: Any) -> bool:
    """Equal as settings: a tuple equals the list JSON gives back, floats up to round-off."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_setting(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12)
    return a == b


def ignored_settings(given: list[dict[str, Any]], loaded: list[dict[str, Any]], scheduled: set[str]) -> str:
    """The settings this run gave its optimizer that the checkpoint's replaced, for one log line
    ("" when none): "weight_decay 0.05 (checkpoint: 0.1)"."""
    changes = [
        f"{key} {mine[key]} (checkpoint: {theirs[key]})"
        for mine, theirs in zip(given, loaded)
        for key in sorted(set(mine) & set(theirs) - scheduled)
        if not _same_setting(mine[key], theirs[key])
    ]
    return ", ".join(dict.fromkeys(changes))  # once per setting that differs alike in several groups


def gradient_averaging(config: RuntimeConfig, dp_size: int) -> tuple[float, float]:
    """DeepSpeed's averaging over data-parallel ranks as (divisor before the all-reduce, divisor
    after it): the predivide factor and dp/factor, or dp and 1 with prescale_gradients, or no
    division at all with gradient_allreduce_op "sum"."""
    if config.gradient_allreduce_op == "sum":
        return 1.0, 1.0
    if config.prescale_gradients:
        return float(dp_size), 1.0
    factor = config.gradient_predivide_factor
    return factor, dp_size / factor


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
        self.optimizer = optimizer or build_optimizer(self.module, config, rank=parallel.rank)
        param_offload = config.zero_optimization.offload_param.device
        if param_offload != "none" and parallel.device.type != "cpu":
            raise ConfigError(
                f"offload_param to {param_offload} is implemented for CPU training only so far; "
                'set offload_param.device to "none" on an accelerator'
            )
        offload = config.zero_optimization.offload_optimizer.device
        if offload != "none" and not isinstance(self.optimizer, CPUAdam):
            raise ConfigError(
                f"offload_optimizer to {offload} needs the optimizer the config builds, but a "
                f"{type(self.optimizer).__name__} was passed; drop the optimizer argument or the offload block"
            )
        if lr_scheduler is not None and config.scheduler is not None:
            raise ConfigError(
                f"a scheduler object was passed and the config also names scheduler {config.scheduler.type!r}; "
                "give only one of them"
            )
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
        if config.activation_checkpointing.cpu_checkpointing and parallel.device.type != "cpu":
            raise ConfigError(
                "activation_checkpointing.cpu_checkpointing (checkpointed activations moved to host "
                "memory) is not built for accelerators; set it to false"
            )
        if parallel.is_first_rank:
            for line in no_effect_notes(config):
                print(line, flush=True)
        self._broadcast_parameters()
        self.pipeline_shared = pipeline_shared(self.module)
        if self.pipeline_shared and config.zero_optimization.stage > 1:
            raise ConfigError(
                f"ZeRO stage {config.zero_optimization.stage} reduces gradients during backward, before the tied word "
                "embedding's gradient can be summed over the first and last pipeline stages; use --zero-stage 0 or 1, "
                "or --untie-embeddings-and-output-weights"
            )
        self.strategy = build_strategy(self.module, self.optimizer, config, parallel)
        if isinstance(self.optimizer, SwappedAdam):  # swap files for the shards the groups hold now
            self.optimizer.prepare(self.strategy.swapped_stores())

    def _broadcast_parameters(self) -> None:
        """Every replica starts from its group's first rank's weights: dense tensors over the
        data-parallel group, experts over their expert-data-parallel group."""
        grid = self.parallel
        for tensor in self.module.state_dict(keep_vars=True).values():
            group = grid.expert_dp_group if expert_ids(tensor) else grid.dp_group
            if is_parallel(group):
                dist.broadcast(tensor.detach(), src=dist.get_global_rank(group, 0), group=group)

    def whole_parameters(self) -> AbstractContextManager[Any]:
        """A context in which every parameter of the model holds its values (ZeRO-3 frees them
        between uses): for saving, loading or inspecting weights outside forward."""
        return self.strategy.full_parameters()

    def autocast(self) -> Any:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.parallel.device.type, dtype=self.autocast_dtype)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.monitor.start("forward")
        with self.autocast(), self.strategy.forward_context():
            output = self.module(*args, **kwargs)
        self.monitor.stop("forward")
        return output

    __call__ = forward

    def backward(
        self, loss: torch.Tensor, activation: torch.Tensor | None = None, activation_grad: torch.Tensor | None = None
    ) -> None:
        """Backward from `loss`; on a pipeline stage before the last, also from the `activation` it
        sent on, with the gradient the next stage sent back (already scaled as the loss is)."""
        self.monitor.record_loss(loss)
        self._loss_nonfinite |= ~torch.isfinite(loss.detach()).all()
        self.monitor.start("backward")
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
        self.monitor.stop("backward")

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def _global_sq_norm(self, dense_grads: list[torch.Tensor], expert_grads: list[torch.Tensor]) -> tuple[float, bool]:
        """Squared norm of all gradients of the model, and whether this rank's own share of them
        is non-finite. Each expert lives on one rank of the expert-parallel group; dense gradients
        are replicated, or under ZeRO split into disjoint shards (over data-parallel ranks, experts
        over expert-data-parallel ranks)."""

        def sq_norm(grads: list[torch.Tensor]) -> torch.Tensor:
            if not grads:
                return torch.zeros((), device=self.parallel.device)
            return torch.nn.utils.get_total_norm(grads, foreach=True).float().square()

        def model_parallel_sq_norm(grads: list[torch.Tensor], kinds: list[str], tp_rank: int) -> torch.Tensor:
            # tensor-parallel slices add up over the group; a gradient every tensor-parallel rank holds
            # whole counts once, a pipeline stage's copy of the first stage's parameter not at all
            sq = sq_norm([g for g, kind in zip(grads, kinds) if kind == SLICE])
            return sq + sq_norm([g for g, kind in zip(grads, kinds) if kind == WHOLE]) if tp_rank == 0 else sq

        grid = self.parallel
        dense_kinds, expert_kinds = self.strategy.gradient_kinds()
        dense_sq = model_parallel_sq_norm(dense_grads, dense_kinds, grid.tp_rank)
        expert_sq = model_parallel_sq_norm(expert_grads, expert_kinds, grid.expert_tp_rank)
        local_nonfinite = ~torch.isfinite(dense_sq + expert_sq)
        self.strategy.sum_square_norms(dense_sq, expert_sq)
        all_reduce(dense_sq, grid.tp_group)
        all_reduce(expert_sq, grid.expert_tp_group)
        all_reduce(expert_sq, grid.ep_group)
        all_reduce(dense_sq, grid.pp_group)  # each stage holds its own layers
        all_reduce(expert_sq, grid.pp_group)
        return float(dense_sq + expert_sq), bool(local_nonfinite)

    def _nonfinite_ranks(self, grads_nonfinite: bool, norm_finite: bool) -> NonFiniteStep | None:
        """Which ranks saw a non-finite loss or gradients in this accumulation (one small
        all-reduce over the world), or None when none did and the global norm is finite."""
        world, rank = self.parallel.world_size, self.parallel.rank
        flags = torch.zeros(2 * world, device=self.parallel.device)
        flags[2 * rank] = self._loss_nonfinite.float()
        flags[2 * rank + 1] = float(grads_nonfinite)
        if world > 1:
            dist.all_reduce(flags)
        self._loss_nonfinite.zero_()
        loss_ranks, grad_ranks = (torch.nonzero(flags[k::2]).flatten().tolist() for k in (0, 1))
        if not norm_finite and not grad_ranks:  # finite shares whose squares overflow together
            grad_ranks = list(range(world))
        return NonFiniteStep(loss_ranks, grad_ranks) if loss_ranks or grad_ranks else None

    def step(self) -> None:
        """Count a micro-batch; at the accumulation boundary reduce, clip and update."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        self.monitor.start("step")
        for param in self.pipeline_shared:
            all_reduce(param.grad, self.parallel.embedding_group)
        dense_grads, expert_grads = self.strategy.reduce_gradients()
        grads = dense_grads + expert_grads
        divisor = self.loss_scaler.scale * self.gradient_accumulation_steps * self.grad_postdivisor
        sq_norm, grads_nonfinite = self._global_sq_norm(dense_grads, expert_grads)
        grad_norm = math.sqrt(sq_norm) / divisor
        self.last_grad_norm = grad_norm
        self.last_nonfinite = self._nonfinite_ranks(grads_nonfinite, math.isfinite(grad_norm))
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
            self.consecutive_skipped_steps = 0
            self.optimizer.step()
            self.strategy.after_step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.loss_scaler.update(self.last_step_skipped)
        self.optimizer.zero_grad(set_to_none=True)
        self.strategy.zero_gradients()
        self.global_steps += 1
        self.monitor.stop("step")
        self.monitor.after_step(self.global_steps, self.skipped_steps, self.get_lr(), self.loss_scaler.scale)

    @property
    def precision(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.autocast_dtype, "fp32")

    def checkpoint_state(self, client_state: dict[str, Any] | None = None) -> EngineState:
        """This rank's share of a checkpoint: the model and optimizer entries it owns under their
        global names, and (first rank) the counters, schedule and loss scale for engine.json."""
        grid = self.parallel
        # each pipeline stage's first rank writes the stage's dense tensors (whole, gathered over tp)
        owns = grid.checkpoint_owners()
        splits = (
            {
                name: split
                for piece in grid.gather_from_all(tensor_parallel_splits(self.module))
                for name, split in piece.items()
            }
            if grid.pp_size > 1
            else tensor_parallel_splits(self.module)
        )
        with self.whole_parameters():
            model = model_entries(self.module, **owns)
        optim, optim_groups = self.strategy.optimizer_state(**owns), optimizer_groups(self.optimizer)
        meta = (
            {
                "global_steps": self.global_steps,
                "micro_steps": self.micro_steps,
                "skipped_steps": self.skipped_steps,
                "optimizer_groups": optim_groups,
                "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                "loss_scaler": self.loss_scaler.state_dict(),
                "client_state": client_state or {},
                "dp_size": grid.dp_size,
                "ep_size": grid.ep_size,
                "tp_size": grid.tp_size,
                "tensor_parallel_splits": splits,
            }
            if grid.is_first_rank
            else None
        )
        return EngineState(model, optim, meta, grid, self.strategy.stage, self.precision)

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
        """DeepSpeed's consolidated weights: every parameter whole, in the training precision (bf16
        or fp16; fp32 without either), experts by global id, in one safetensors file written by
        the first rank. Under ZeRO-3 only with stage3_gather_16bit_weights_on_model_save, as in
        DeepSpeed: without it nothing is written and the answer is False."""
        if not save_filename.endswith(".safetensors"):
            raise ConfigError(
                f"save_16bit_model writes safetensors (nothing here is pickled); name the file "
                f"{Path(save_filename).stem}.safetensors instead of {save_filename}"
            )
        grid, path = self.parallel, Path(save_dir) / save_filename
        if self.strategy.stage == 3 and not self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
            if grid.is_first_rank:
                print(
                    f" > did not save {path}: ZeRO-3 holds partitions and "
                    "zero_optimization.stage3_gather_16bit_weights_on_model_save is false",
                    flush=True,
                )
            return False
        dtype = self.autocast_dtype or torch.float32
        with self.whole_parameters():
            owned = model_entries(self.module, **grid.checkpoint_owners())
            owned = {name: t.to(dtype, copy=True) if t.is_floating_point() else t.clone() for name, t in owned.items()}
        pieces = [owned]
        if grid.world_size > 1:
            pieces = [{}] * grid.world_size if grid.is_first_rank else None
            dist.gather_object(owned, pieces, dst=0)
        if grid.is_first_rank:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(path.name + ".partial")  # a crash leaves no half-written weights
            save_tensors(partial, {name: t for piece in pieces for name, t in piece.items()})
            partial.replace(path)
        return True

    def load_checkpoint(
        self,
        load_dir: str | Path,
        tag: str,
        load_optimizer: bool = True,
        load_rng: bool = True,
        verify: bool = True,
    ) -> dict[str, Any]:
        """Restore model (and optimizer, schedule, loss scale, RNG) after checking every file
        against the manifest (`verify=False` when the caller has just done so); returns the client state."""
        folder = Path(load_dir) / tag
        if verify:
            verify_folder(folder, self.parallel)
        meta = read_engine_meta(folder)
        try:
            self._restore(folder, meta, load_optimizer, load_rng)
        except KeyError as missing:
            raise DamagedCheckpoint(f"{folder / ENGINE_FILE} lacks {missing}; load an earlier checkpoint") from None
        return meta.get("client_state", {})

    def _scheduled_keys(self) -> set[str]:
        """Group settings the LR schedule sets itself (after a resume too)."""
        keys = {"lr", "initial_lr"}
        get_mom = getattr(self.lr_scheduler, "get_mom", None)
        if get_mom is not None and get_mom() is not None:
            keys.add("betas")
        return keys

    def _restore(self, folder: Path, meta: dict[str, Any], load_optimizer: bool, load_rng: bool) -> None:
        with self.whole_parameters():
            load_model_entries(self.module, ShardedReader(folder, MODEL))
            self.strategy.copy_from_parameters()
        if load_optimizer and meta.get("weights_only"):  # e.g. imported from Hugging Face
            load_optimizer = False
            if self.parallel.is_first_rank:
                print(
                    f" > {folder} holds weights only: the optimizer, loss scale and LR schedule start afresh",
                    flush=True,
                )
        if load_optimizer:
            reader = ShardedReader(folder, OPTIMIZER, meta.get("tensor_parallel_splits"))
            given = optimizer_groups(self.optimizer)
            self.strategy.load_optimizer_state(reader, meta["optimizer_groups"])
            if self.lr_scheduler is not None and meta["lr_scheduler"] is not None:
                # the schedule steps once per optimizer step that was not skipped
                steps_taken = meta["global_steps"] - meta["skipped_steps"]
                changed = restore_schedule(self.lr_scheduler, meta["lr_scheduler"], steps_taken)
                if changed and self.parallel.is_first_rank:
                    print(changed, flush=True)
            ignored = ignored_settings(given, optimizer_groups(self.optimizer), self._scheduled_keys())
            if ignored and self.parallel.is_first_rank:
                print(
                    f" > resuming: this run's optimizer {ignored} is ignored: the checkpoint's optimizer state "
                    "keeps its own, as in DeepSpeed and Megatron; load with --no-load-optim (load_optimizer=False) "
                    "to start the optimizer afresh with the new settings",
                    flush=True,
                )
            self.loss_scaler.load_state_dict(meta["loss_scaler"])
            # count micro-batches in this run's accumulation: another data-parallel size changes it
            self.global_steps = meta["global_steps"]
            self.micro_steps = self.global_steps * self.gradient_accumulation_steps
            self.skipped_steps = meta["skipped_steps"]
        rng_path = folder / rank_file(RNG, self.parallel.rank)
        if load_rng and rng_path.is_file():
            load_rng_state(rng_path)
        elif load_rng and self.parallel.is_first_rank:
            print(
                f" > {folder} has no RNG state for rank {self.parallel.rank} (saved with another world size): "
                "random streams start afresh",
                flush=True,
            )


def initialize(
    model: nn.Module,
    config: dict[str, Any] | str | Path | RuntimeConfig,
    parallel: ParallelGrid,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    model_parameters: Iterable[Any] | None = None,
) -> Engine:
    """DeepSpeed-style entry point: validate the config and wrap the model in an engine. Without an
    optimizer, the config's is built over `model_parameters` (default: the model's)."""
    if not isinstance(config, RuntimeConfig):
        config = load_runtime_config(config, parallel.dp_size)
    if optimizer is not None and model_parameters is not None:
        raise ConfigError("give initialize() an optimizer or model_parameters to build one from, not both")
    if optimizer is None:
        optimizer = build_optimizer(model, config, model_parameters, parallel.rank)
    return Engine(model, config, parallel, optimizer=optimizer, lr_scheduler=lr_scheduler)
