"""The pretraining loop: build tokenizer, model, engine and data from one `PretrainConfig`,
then train, evaluate, log and checkpoint, Megatron-style."""

import random
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from megatron.checkpoint.async_save import AsyncCheckpointSaver, SavedCheckpoint
from megatron.checkpoint.iterations import (
    ResumePoint,
    holds_checkpoints,
    resume_point,
    save_checkpoint,
    saved_iterations,
)
from megatron.checkpoint.layout import LATEST_FILE
from megatron.checkpoint.manifest import RunRecord
from megatron.checkpoint.save_lock import hold_save_lock
from megatron.config.flags import PretrainConfig
from megatron.data.loader import build_pretraining_loader, sampled_loader
from megatron.data.tokenizer import Tokenizer, padded_vocab_size, tokenizer_of
from megatron.errors import CheckpointError, ConfigError, TrainingStopped
from megatron.model import GPTModel
from megatron.model.moe.expert_bias import update_expert_biases
from megatron.model.pipeline_stage import pipeline_stage
from megatron.model.tensor_parallel import TensorParallel
from megatron.parallel import ParallelGrid, all_reduce
from megatron.profiling.peak_flops import peak_flops
from megatron.runtime.config.schema import RuntimeConfig
from megatron.runtime.engine import initialize
from megatron.runtime.lr_schedules import AnnealingLR
from megatron.runtime.optimizer_factory import build_optimizer
from megatron.runtime.pipeline_schedule import StageLinks, forward_only, one_forward_one_backward
from megatron.timers import Timers, timed, untimed
from megatron.tokenizer_spec import tokenizer_spec_of
from megatron.training.curriculum import curriculum_sampling_for, sequence_curriculum
from megatron.training.distill import init_student_from_teacher, load_teacher, teacher_checkpoint
from megatron.training.exit_conditions import ExitConditions
from megatron.training.log import IntervalStats, LogWindow, TrainingLogger
from megatron.training.losses import Losses
from megatron.training.moe_monitor import MoEMonitor
from megatron.training.random_ltd_schedule import random_ltd_for
from megatron.training.run_datasets import run_datasets
from megatron.training.run_length import TokenCount, run_length
from megatron.training.step import ForwardStep, GPTBatch, StageForward, forward_step, gpt_batch
from megatron.training.upcycling import upcycle_from_checkpoint


@dataclass
class TrainResult:
    """What a run did, for callers and tests: per-iteration losses and validation losses."""

    iteration: int = 0
    losses: list[float] = field(default_factory=list)
    kd_losses: list[float] = field(default_factory=list)  # T^2 * KL to the teacher per iteration, 0 without KD
    validation: list[tuple[int, float]] = field(default_factory=list)
    test_loss: float | None = None
    checkpoint: str | None = None
    exit_reason: str | None = None  # why the run stopped before --train-iters


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_summary(runtime: RuntimeConfig, grid: ParallelGrid) -> str:
    """The settings that decide a run's memory and speed, for the log's first line."""
    zero = runtime.zero_optimization
    sizes = {"tensor": grid.tp_size, "expert-tensor": grid.expert_tp_size, "pipeline": grid.pp_size}
    model_parallel = "".join(f"{kind}-parallel {size} | " for kind, size in sizes.items() if size > 1)
    return (
        f" > run: world size {grid.world_size} | data-parallel {grid.dp_size} | expert-parallel {grid.ep_size} | "
        f"{model_parallel}"
        f"ZeRO stage {zero.stage} | precision {runtime.precision} | optimizer {runtime.optimizer.type} | "
        f"optimizer offload {zero.offload_optimizer.device} | parameter offload {zero.offload_param.device} | "
        f"global batch {runtime.train_batch_size} = micro batch {runtime.train_micro_batch_size_per_gpu} x "
        f"accumulation {runtime.gradient_accumulation_steps} x data-parallel {grid.dp_size}"
    )


class Trainer:
    def __init__(self, config: PretrainConfig, grid: ParallelGrid, forward: ForwardStep = forward_step) -> None:
        self.config = config
        self.grid = grid
        self.forward = forward  # every micro-batch's forward, in training and evaluation (step.py)
        t = config.training
        built = {
            "expert": (grid.ep_size, t.expert_parallel_size),
            "tensor": (grid.tp_size, t.tensor_parallel_size),
            "expert-tensor": (grid.expert_tp_size, t.expert_tensor_parallel_size),
            "pipeline": (grid.pp_size, t.pipeline_parallel_size),
        }
        for kind, (grid_size, flag_size) in built.items():
            if grid_size != flag_size:
                raise ConfigError(
                    f"the rank grid has {kind}-parallel size {grid_size} but the flags ask for {flag_size}; "
                    "build the grid from the same flags (build_parallel_grid)"
                )
        self.log = TrainingLogger(config.logging.tensorboard_dir, enabled=grid.is_first_rank)
        self.runtime = runtime = config.runtime_config(grid.dp_size)
        self.log.info(run_summary(runtime, grid))
        set_seed(config.training.seed)
        data = config.data
        self.tokenizer: Tokenizer = tokenizer_of(tokenizer_spec_of(data))
        curriculum = sequence_curriculum(runtime.curriculum_learning, runtime.data_efficiency, config)
        self.random_ltd = random_ltd_for(runtime.data_efficiency, config)
        self.count = TokenCount(config, curriculum, self.random_ltd)
        self.length = run_length(config, self.count)  # the datasets hold its iterations' samples
        # data first: a bad prefix or corrupt index stops the run before the model is built
        self.train_data, self.valid_data, self.test_data = self._build_datasets()
        # as Megatron pads it: every tensor-parallel rank gets an equal share of whole multiples
        vocab = padded_vocab_size(self.tokenizer.vocab_size, data.make_vocab_size_divisible_by * grid.tp_size)
        self.model_config = replace(config.model, vocab_size=vocab)
        tp = TensorParallel(grid.tp_group, t.sequence_parallel, grid.expert_tp_group)
        stage = pipeline_stage(
            config.model.num_layers, grid.pp_size, grid.pp_rank, t.first_stage_layers, t.last_stage_layers
        )
        model = GPTModel(self.model_config, ep_group=grid.ep_group, tp=tp, stage=stage).to(grid.device)
        self.moe_monitor = MoEMonitor()
        self.curriculum_sampling = curriculum_sampling_for(runtime.data_efficiency, config)
        if self.random_ltd is not None:
            model.random_ltd = self.random_ltd.layers
        lg = config.logging
        self.timers = (
            Timers(lg.timing_log_level, lg.timing_log_option, grid.device) if lg.timing_log_level > 0 else None
        )
        ckpt = config.checkpoint
        self.load_dir = ckpt.load
        if ckpt.moe_use_upcycling:
            self.load_dir = self._upcycle(model)
        self.resume_from = (
            resume_point(
                self.load_dir,
                grid,
                ckpt.ckpt_step if self.load_dir == ckpt.load else None,
                None if ckpt.reset_iteration else self.length.train_iters,
                self.log.info,
                model=self.model_config,  # the checkpoint's model compared with this one's, field by field
                weights_only=ckpt.reset_iteration,
            )
            if self.load_dir
            else None
        )
        self._refuse_overwriting_checkpoints()
        # teacher checks and the student's init from the teacher come before the engine copies the weights
        self.teacher, self.distilling = self._setup_teacher(model, self.resume_from is None)
        optimizer = build_optimizer(model, runtime, rank=grid.rank, grid=grid)
        scheduler = (
            None
            if runtime.scheduler is not None
            else AnnealingLR(  # else the engine builds the config's
                optimizer,
                max_lr=runtime.optimizer.params.lr,
                min_lr=t.min_lr,
                warmup_steps=t.lr_warmup_tokens,
                decay_steps=self.length.lr_decay_tokens,
                decay_style=t.lr_decay_style,
                increment=t.tokens_per_iteration,
            )
        )
        n_params = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them
        self.engine = initialize(model, runtime, grid, optimizer=optimizer, lr_scheduler=scheduler)
        self.log.info(
            f" > GPT model: {n_params:,} parameters on this rank, padded vocabulary {vocab} "
            f"(tokenizer {self.tokenizer.vocab_size}), data-parallel size {grid.dp_size}, "
            f"expert-parallel size {grid.ep_size}, experts per layer {self.model_config.experts_per_layer}"
        )
        self.iteration = 0
        self.consumed_samples = 0
        self.consumed_tokens = 0  # as counted by self.count: fewer under a curriculum or random-LTD
        self.saved_iteration: int | None = None
        # --async-save: checkpoints written in the background, at most one in flight
        background = config.checkpoint.async_save or runtime.checkpoint.decoupled  # DeepSpeed's spelling of it
        self.saver = AsyncCheckpointSaver(grid, self.log.info) if background else None
        self.window = LogWindow()  # the iterations since the last log line (a resume carries them)
        self.run_start = (0, 0)  # iteration and skipped steps where train() began
        if self.resume_from is not None:
            self._load(self.resume_from)

    def _refuse_overwriting_checkpoints(self) -> None:
        """A run that starts at iteration 0 would save over the checkpoints of an earlier run."""
        ckpt = self.config.checkpoint
        starts_at_zero = self.resume_from is None or ckpt.reset_iteration
        if ckpt.save and starts_at_zero and not ckpt.overwrite_checkpoints and holds_checkpoints(ckpt.save):
            newest = max(saved_iterations(ckpt.save), default=None)
            held = f"checkpoints up to iteration {newest}" if newest is not None else f"a {LATEST_FILE}"
            raise CheckpointError(
                f"--save {ckpt.save} already holds {held} and this run starts from iteration 0, so it would overwrite "
                f"them; add --load {ckpt.save} to resume, or --overwrite-checkpoints to start afresh over them"
            )

    def _upcycle(self, model: GPTModel) -> str | None:
        """--moe-use-upcycling: `model` starts from the dense checkpoint in --load, unless --save
        already holds this run's checkpoints (a restart), which it then resumes. Returns the
        folder to resume from, if any."""
        ckpt = self.config.checkpoint
        if ckpt.save and holds_checkpoints(ckpt.save):
            self.log.info(
                f" > --moe-use-upcycling: --save {ckpt.save} holds checkpoints, so this run resumes them "
                f"instead of upcycling {ckpt.load} again"
            )
            return ckpt.save
        self.log.info(upcycle_from_checkpoint(model, ckpt.load, self.grid, ckpt.ckpt_step))
        return None

    def _load(self, point: ResumePoint) -> None:
        ckpt = self.config.checkpoint
        run = point.manifest.run
        if run is None:
            raise CheckpointError(
                f"{point.folder} holds no record of a training run (it was saved through the engine alone); "
                "--load a checkpoint saved by pretrain_gpt.py"
            )
        self.engine.load_checkpoint(
            self.load_dir,
            point.folder.name,
            load_optimizer=ckpt.load_optim and not ckpt.reset_iteration,
            load_rng=ckpt.load_rng,
            manifest=point.manifest,  # read and verified by resume_point
        )
        self.log.info(f" > loaded checkpoint {self.load_dir}/{point.folder.name} at iteration {point.iteration}")
        if ckpt.reset_iteration:
            self.log.info(
                f" > --reset-iteration: weights from {ckpt.load} (iteration {run.iteration}), "
                "fresh optimizer and LR schedule, starting at iteration 0"
            )
        else:
            self.iteration = self.saved_iteration = run.iteration
            self.consumed_samples = run.consumed_samples
            self.consumed_tokens = run.consumed_tokens
            self.window = LogWindow.from_record(run.log_window, self.grid.rank, self.grid.world_size, self.grid.device)

    def _setup_teacher(self, model: GPTModel, starts_fresh: bool) -> tuple[GPTModel | None, bool]:
        """Check the teacher, initialise a fresh student from it if asked, and return it while KD
        is still to run, and whether KD runs; a run resuming after the KD stop does not read the
        teacher at all. Under pipeline parallelism only the last stage, which computes the loss,
        holds the teacher: all its layers, split by TP and EP as the student's are."""
        d, ckpt = self.config.distill, self.config.checkpoint
        if d is None:
            return None, False
        start = 0 if starts_fresh or ckpt.reset_iteration or self.resume_from is None else self.resume_from.iteration
        init = d.init_from_teacher and starts_fresh
        if not d.kd_active(start) and not init:
            if d.kd:
                self.log.info(
                    f" > knowledge distillation stopped at iteration {d.stop_iteration} and this run resumes "
                    f"at {start}: the teacher is not loaded"
                )
            return None, False
        folder, saved = teacher_checkpoint(d, self.model_config, self.config.training.seq_length, self.grid)
        if init:
            self.log.info(init_student_from_teacher(model, folder, saved))
        if not d.kd_active(start):
            return None, False
        until = f"until iteration {d.stop_iteration}" if d.stop_iteration is not None else "for the whole run"
        about = (
            f"{saved.num_layers} layers, experts per layer {saved.experts_per_layer}; KD alpha {d.alpha_ce} "
            f"beta {d.beta_ce} temperature {d.temperature}, {until}"
        )
        if not self.grid.is_last_stage:
            self.log.info(f" > teacher {folder}: {about}; it runs on the last pipeline stage, whole")
            return None, True
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.runtime.precision)
        teacher = load_teacher(folder, saved, self.grid, dtype, model.tp)
        self.log.info(
            f" > teacher {folder}: {sum(p.numel() for p in teacher.parameters()):,} parameters on this rank, {about}"
        )
        return teacher, True

    def _stop_kd(self) -> None:
        self.teacher, self.distilling = None, False  # the only reference: its memory goes back now
        if self.grid.device.type == "cuda":
            torch.cuda.empty_cache()
        self.log.info(
            f" > knowledge distillation stopped at iteration {self.iteration}: teacher freed, "
            "training continues on the LM loss alone"
        )

    def _build_datasets(self) -> tuple[Any, Any, Any]:
        """The first rank builds (and caches) the index arrays; the others then load them."""
        if self.grid.is_first_rank:
            datasets = run_datasets(self.config, self.tokenizer.vocab_size, self.length.train_iters)
        self.grid.barrier()
        if not self.grid.is_first_rank:
            datasets = run_datasets(self.config, self.tokenizer.vocab_size, self.length.train_iters)
        return datasets

    def loader(self, dataset: Any, consumed_samples: int) -> Iterator[dict[str, torch.Tensor]]:
        loader = build_pretraining_loader(
            dataset,
            consumed_samples,
            self.config.training.micro_batch_size,
            self.grid.dp_rank,
            self.grid.dp_size,
            num_workers=self.config.data.num_workers,
        )
        return iter(loader)

    def train_loader(self) -> Iterator[dict[str, torch.Tensor]]:
        """The training batches from the next iteration on: in the curriculum's order under curriculum
        sampling, else in order."""
        if self.curriculum_sampling is None:
            return self.loader(self.train_data, self.consumed_samples)
        sampler = self.curriculum_sampling.sampler(
            len(self.train_data), self.config, self.grid.dp_rank, self.grid.dp_size, self.iteration
        )
        return iter(sampled_loader(self.train_data, sampler, self.config.data.num_workers))

    def _batch(self, data_iter: Iterator[dict[str, torch.Tensor]], seq_length: int | None = None) -> GPTBatch:
        """The next micro-batch, its sequences cut to `seq_length` when given."""
        with timed("batch-generator"):
            text = next(data_iter)["text"]
            if seq_length is not None:
                text = text[:, : seq_length + 1]  # the inputs and the labels they predict
            return gpt_batch(text, self.tokenizer.eod, self.config.data.eod_mask_loss, self.grid.device)

    def dp_mean(self, value: torch.Tensor) -> float:
        value = value.clone()
        all_reduce(value, self.grid.dp_group)
        return float(value / self.grid.dp_size)

    def _train_forward(
        self, batch: GPTBatch, hidden_BSH: torch.Tensor | None = None
    ) -> tuple[StageForward, torch.Tensor]:
        """A training micro-batch's forward on this stage and the objective it backpropagates; its
        routing statistics go to the MoE monitor."""
        d = self.config.distill
        step = self.forward(self.engine, batch, self.teacher, d.temperature if d else 1.0, hidden_BSH)
        self.moe_monitor.accumulate(step.routing)
        return step, step.losses.objective(d if self.teacher is not None else None)

    def train_step(self, data_iter: Iterator[dict[str, torch.Tensor]]) -> Losses:
        """One global batch: every micro-batch forward + backward, then the engine's step.
        Returns the mean loss terms of its micro-batches."""
        self.engine.module.train()
        if self.random_ltd is not None:
            self.random_ltd.begin_iteration(self.iteration + 1)
        seq_length = self.count.seq_length(self.iteration + 1)
        if isinstance(self.engine.lr_scheduler, AnnealingLR):  # Megatron's schedule counts the tokens trained
            self.engine.lr_scheduler.increment = self.count.tokens(self.iteration + 1)
        if self.grid.pp_size > 1:
            return self._pipeline_train_step(data_iter, seq_length)
        total = Losses.zeros(self.grid.device)
        micro_batches = self.engine.gradient_accumulation_steps
        with timed("forward-backward"):
            for index in range(micro_batches):
                step, objective = self._train_forward(self._batch(data_iter, seq_length))
                self.engine.backward(objective)
                if index < micro_batches - 1:  # the last one's is the update, after the timer
                    self.engine.step()
                total = total + step.losses.detach()
        self._before_the_update()
        self.engine.step()
        update_expert_biases(self.engine.module, self.grid.stage_group, step_taken=not self.engine.last_step_skipped)
        return total / self.engine.gradient_accumulation_steps

    def _stage_links(self, seq_length: int) -> StageLinks:
        t, grid = self.config.training, self.grid
        positions = seq_length // grid.tp_size if t.sequence_parallel else seq_length
        return StageLinks(
            grid.pp_prev_rank,
            grid.pp_next_rank,
            (t.micro_batch_size, positions, self.model_config.hidden_size),
            torch.float32,
            grid.device,
        )

    def _pipeline_train_step(self, data_iter: Iterator[dict[str, torch.Tensor]], seq_length: int) -> Losses:
        """The global batch's micro-batches in the 1F1B schedule; every stage reads the same ones
        (the first needs the tokens, the last the labels). The LM loss comes from the last stage;
        the router losses add up over the stages; with a teacher (the last stage's) its KD term too."""
        engine, grid = self.engine, self.grid
        batches = [self._batch(data_iter, seq_length) for _ in range(engine.gradient_accumulation_steps)]
        total = Losses.zeros(grid.device)

        def forward(index: int, hidden_BSH: torch.Tensor | None) -> tuple[torch.Tensor | None, object]:
            nonlocal total
            step, objective = self._train_forward(batches[index], hidden_BSH)
            total = total + step.losses.detach()
            return step.hidden_BSH, (objective, step.hidden_BSH, hidden_BSH)

        def backward(saved: object, grad_BSH: torch.Tensor | None) -> torch.Tensor | None:
            objective, output, hidden_BSH = saved
            engine.backward(objective, output, grad_BSH)
            if not engine.is_gradient_accumulation_boundary():  # the update waits for the schedule's last send
                engine.step()
            return None if hidden_BSH is None else hidden_BSH.grad

        with timed("forward-backward"):
            one_forward_one_backward(
                len(batches), grid.pp_rank, grid.pp_size, self._stage_links(seq_length), forward, backward
            )
        self._before_the_update()
        engine.step()
        update_expert_biases(engine.module, grid.stage_group, step_taken=not engine.last_step_skipped)
        return total.summed_over(grid.pp_group) / len(batches)

    def evaluate(self, dataset: Any) -> float:
        """Mean LM loss over the first --eval-iters global batches of `dataset`, so every
        evaluation of a run sees the same tokens and the curve is comparable."""
        with untimed():
            return self._evaluate(dataset)

    @torch.no_grad()
    def _evaluate(self, dataset: Any) -> float:
        self.engine.module.eval()
        data_iter = self.loader(dataset, 0)
        total = torch.zeros((), device=self.grid.device)
        steps = self.config.logging.eval_iters * self.engine.gradient_accumulation_steps
        if self.grid.pp_size > 1:  # the last stage's losses, summed over the pipeline for every rank
            batches = [self._batch(data_iter) for _ in range(steps)]

            def forward(index: int, hidden_BSH: torch.Tensor | None) -> tuple[torch.Tensor | None, object]:
                nonlocal total
                step = self.forward(self.engine, batches[index], hidden_BSH=hidden_BSH)
                total += step.losses.lm
                return step.hidden_BSH, None

            forward_only(steps, self._stage_links(self.config.training.seq_length), forward)
            all_reduce(total, self.grid.pp_group)
        else:
            for index in range(steps):
                total += self.forward(self.engine, self._batch(data_iter)).losses.lm
                self.log.progress("evaluation micro-batches", index + 1, steps)
        self.engine.module.train()
        return self.dp_mean(total / steps)

    def _save(self, result: TrainResult) -> None:
        # saved between two log lines (on every rank alike), the window is what the next line needs
        window = self.window.record(self.grid.gather_from_all(self.window.as_lists())) if self.window.losses else None
        data = self.config.data
        run = RunRecord(
            iteration=self.iteration,
            consumed_samples=self.consumed_samples,
            consumed_tokens=self.consumed_tokens,
            model=self.model_config,
            tokenizer=tokenizer_spec_of(data),
            tokenizer_size=self.tokenizer.vocab_size,
            log_window=window,
            training_data=list(data.data_path or data.train_data_path or ()) or None,
            command_line=shlex.join(sys.argv),
        )
        save_dir = self.config.checkpoint.save
        if self.saver is not None:
            with timed("save-checkpoint"):
                state = self.engine.checkpoint_state()
                previous = self.saver.start(state, save_dir, self.iteration, run, overlap=self._overlapped_copy())
            self._saved_in_background(result, previous)
            self.log.info(f" > saving checkpoint at iteration {self.iteration} to {save_dir} in the background")
            return
        self.log.info(f" > saving checkpoint at iteration {self.iteration} to {save_dir}")
        start = time.perf_counter()
        with timed("save-checkpoint"):
            path = save_checkpoint(self.engine, save_dir, self.iteration, run)
        result.checkpoint = str(path)
        self.saved_iteration = self.iteration
        self.log.info(
            f" > saved checkpoint at iteration {self.iteration} to {path} in {time.perf_counter() - start:.1f} s"
        )

    def _before_the_update(self) -> None:
        """An overlapped background save copies the state while the next forward and backward run;
        the update, which changes it, waits for the copy."""
        if self.saver is not None:
            self.saver.wait_for_copy()

    def _overlapped_copy(self) -> bool:
        """Whether the state's tensors stay untouched until the next update (so a background save may
        copy them meanwhile): not under ZeRO stage 3, whose gathered weights are buffers that the next
        forward reuses, nor with offload, whose swap buffers are."""
        zero = self.runtime.zero_optimization
        offloaded = zero.offload_optimizer.device != "none" or zero.offload_param.device != "none"
        return self.engine.strategy.stage <= 2 and not offloaded

    def _saved_in_background(self, result: TrainResult, saved: SavedCheckpoint | None) -> None:
        if saved is None:
            return
        result.checkpoint, self.saved_iteration = str(saved.folder), saved.iteration
        self.log.info(
            f" > saved checkpoint at iteration {saved.iteration} to {saved.folder} in {saved.seconds:.1f} s in the "
            f"background (training waited {saved.blocked_seconds:.2f} s for the copy)"
        )

    def _settle_save(self, result: TrainResult) -> None:
        """Wait for the save in flight, if any: before an exit, the end, or a stop."""
        if self.saver is not None:
            self._saved_in_background(result, self.saver.wait())

    def _check_step(self, result: TrainResult) -> None:
        """The non-finite policy: bf16/fp32 stop at the first non-finite loss or gradient (unless
        --no-check-for-nan-in-loss-and-grad); any run stops when too many steps in a row were skipped.
        A save in flight is finished first: it holds the state before the bad step."""
        t, engine = self.config.training, self.engine
        limit = t.max_consecutive_skipped_iterations
        nonfinite_stop = engine.last_nonfinite is not None and t.check_for_nan and self.runtime.precision != "fp16"
        skipped_stop = bool(limit) and engine.consecutive_skipped_steps >= limit
        if nonfinite_stop or skipped_stop:
            self._settle_save(result)
        last_saved = f"iteration {self.saved_iteration}" if self.saved_iteration is not None else "none"
        if nonfinite_stop:
            raise TrainingStopped(
                f"iteration {self.iteration}: {engine.last_nonfinite.describe()}, so the run stopped without saving "
                f"(last checkpoint: {last_saved}); resume from it with a lower --lr or check the data, or pass "
                "--no-check-for-nan-in-loss-and-grad to skip such steps"
            )
        if skipped_stop:
            raise TrainingStopped(
                f"iteration {self.iteration}: the last {engine.consecutive_skipped_steps} iterations all skipped their "
                f"step ({engine.last_nonfinite.describe()}), so the run stopped without saving (last checkpoint: "
                f"{last_saved}); lower --lr or train in bf16, or raise --max-consecutive-skipped-iterations"
            )

    def _validate(self, result: TrainResult) -> None:
        if self.valid_data is not None:
            loss = self.evaluate(self.valid_data)
            result.validation.append((self.iteration, loss))
            self.log.evaluation_line("validation", self.iteration, loss)

    def train(self) -> TrainResult:
        exits = ExitConditions(self.config.exit, self.grid)
        try:
            timing = self.timers.recording() if self.timers is not None else nullcontext()
            with self.engine.comms_recording(), timing:  # the pipeline's sends and the loop's reductions too
                result = self._train(exits)
        finally:
            exits.close()
            if self.saver is not None:
                self.saver.close()
        if self.engine.comms_log is not None:
            self.engine.comms_log.log_summary()
        return result

    def _train(self, exits: ExitConditions) -> TrainResult:
        cfg, t = self.config, self.config.training
        result = TrainResult(iteration=self.iteration)
        self.run_start = (self.iteration, self.engine.skipped_steps)  # this run's skipped steps count from here
        if self.iteration >= self.length.train_iters:  # a finished run started again: its last checkpoint is loaded
            self.log.info(
                f" > training is already complete at iteration {self.iteration} of {self.length.train_iters}; "
                "raise --train-iters to train further"
            )
        if cfg.logging.eval_at_start and self.iteration == 0:
            self._validate(result)
        data_iter = self.train_loader() if self.iteration < self.length.train_iters else None
        peak = peak_flops(self.grid.device, self.engine.autocast_dtype or torch.float32, cfg.logging.peak_tflops)
        self.log.info(f" > MFU in the log is against {peak.tflops:.3f} TFLOP/s per rank, from {peak.source}")
        window = self.window  # read back once per log interval: no per-step sync
        to_tensorboard = cfg.logging.log_timers_to_tensorboard
        interval_start, interval_skipped = time.perf_counter(), self.engine.skipped_steps - window.skipped
        interval_tokens, interval_flops = 0, 0.0  # this run's iterations of the interval
        while self.iteration < self.length.train_iters:
            window.losses.append(self.train_step(data_iter))
            self.iteration += 1
            seq_length = self.count.seq_length(self.iteration)
            self.consumed_samples += t.global_batch_size
            self.consumed_tokens += self.count.tokens(self.iteration)
            interval_tokens += t.global_batch_size * seq_length
            interval_flops += self.model_config.flops_per_token(seq_length) * t.global_batch_size * seq_length
            window.skipped = self.engine.skipped_steps - interval_skipped
            self._check_step(result)
            if self.saver is not None:
                self._saved_in_background(result, self.saver.poll())
            self.log.progress("iterations done", self.iteration, self.length.train_iters)
            exit_reason = exits.reason(self.iteration)
            if self.distilling and not cfg.distill.kd_active(self.iteration):
                self._stop_kd()
            if (
                self.iteration % cfg.logging.log_interval == 0
                or self.iteration == self.length.train_iters
                or exit_reason
            ):
                if self.grid.device.type == "cuda":
                    torch.cuda.synchronize()
                seconds = (time.perf_counter() - interval_start) / (len(window.losses) - window.carried)
                interval = window.stacked()  # each term [iterations]
                result.losses += interval.lm[window.carried :].tolist()
                result.kd_losses += interval.kd[window.carried :].tolist()
                means = Losses.from_vector(interval.vector().mean(0))
                lm, moe, kd = self.dp_mean(means.lm), self.dp_mean(means.moe), self.dp_mean(means.kd)
                kd_in_interval = cfg.distill is not None and cfg.distill.kd_active(self.iteration - len(window.losses))
                iterations = len(window.losses) - window.carried
                tflops = interval_flops / iterations / seconds / 1e12 / self.grid.world_size
                self.log.training_line(
                    self.iteration,
                    self.length.train_iters,
                    IntervalStats(
                        consumed_samples=self.consumed_samples,
                        consumed_tokens=self.consumed_tokens,
                        iteration_ms=1000.0 * seconds,
                        lr=self.engine.get_lr()[0],
                        global_batch_size=t.global_batch_size,
                        lm_loss=lm,
                        moe_loss=moe if self.model_config.is_moe else None,
                        kd_loss=kd if kd_in_interval else None,
                        loss_scale=self.engine.loss_scaler.scale if self.runtime.precision == "fp16" else None,
                        grad_norm=self.engine.last_grad_norm,
                        skipped=window.skipped,
                        skipped_total=self.engine.skipped_steps,
                        tokens_per_second=interval_tokens / iterations / seconds,
                        tflops=tflops,
                        mfu=tflops / peak.tflops,
                    ),
                )
                self.log.moe_lines(self.iteration, self.moe_monitor.report(self.grid.stage_group, self.grid.pp_group))
                if self.engine.comms_log is not None:
                    self.log.comms_totals(self.iteration, self.engine.comms_log.totals())
                if self.timers is not None:  # every rank's, so every rank reads them
                    readings = self.timers.readings(len(window.losses) - window.carried)
                    self.log.timer_lines(self.iteration, self.timers.log_text(readings), readings, to_tensorboard)
                if not exit_reason:  # the exit's save keeps the window: the resumed run's next line is this run's
                    self.window = window = LogWindow()
                    interval_start, interval_skipped = time.perf_counter(), self.engine.skipped_steps
                    interval_tokens, interval_flops = 0, 0.0
            if exit_reason:
                return self._exit_early(result, exit_reason)
            if self.iteration % cfg.logging.eval_interval == 0:
                self._validate(result)
            if (
                cfg.checkpoint.save
                and cfg.checkpoint.save_interval
                and self.iteration % cfg.checkpoint.save_interval == 0
            ):
                self._save(result)
        result.iteration = self.iteration
        self._settle_save(result)
        self._refuse_a_run_that_trained_nothing()
        if self.length.train_iters % cfg.logging.eval_interval:
            self._validate(result)
        if self.test_data is not None:
            result.test_loss = self.evaluate(self.test_data)
            self.log.evaluation_line("test", self.iteration, result.test_loss)
        if cfg.checkpoint.save and self.saved_iteration != self.iteration:
            self._save(result)
            self._settle_save(result)
        self._summary(result)
        self.log.close()
        return result

    def _skipped_this_run(self) -> str | None:
        """How many of this run's iterations skipped their step, for its last line; None when none did."""
        start_iteration, start_skipped = self.run_start
        skipped = self.engine.skipped_steps - start_skipped
        if not skipped:
            return None
        fp16 = self.runtime.precision == "fp16"
        scale = f"; the fp16 loss scale is {self.engine.loss_scaler.scale:g} now" if fp16 else ""
        return (
            f"{skipped} of the {self.iteration - start_iteration} iterations of this run skipped their step "
            f"(non-finite gradients{scale})"
        )

    def _refuse_a_run_that_trained_nothing(self) -> None:
        """Every iteration of this run skipped its step (an fp16 loss scale far too high, say): stop
        with one sentence, before the end's save, rather than exit 0 as if it had trained."""
        start_iteration, start_skipped = self.run_start
        trained = self.iteration - start_iteration
        if not trained or self.engine.skipped_steps - start_skipped < trained:
            return
        engine, fp16 = self.engine, self.runtime.fp16
        why = engine.last_nonfinite.describe() if engine.last_nonfinite is not None else "the gradients are not finite"
        if self.runtime.precision != "fp16":
            fix = "lower --lr, or check the data and the checkpoint loaded"
        elif fp16.loss_scale > 0:
            why += f" at the static fp16 loss scale {engine.loss_scaler.scale:g}"
            fix = "lower --loss-scale or leave it out to scale dynamically, or train in bf16"
        else:
            why += f"; the dynamic fp16 loss scale came down to {engine.loss_scaler.scale:g}"
            fix = "lower --initial-loss-scale or --lr, or train in bf16"
        last_saved = f"iteration {self.saved_iteration}" if self.saved_iteration is not None else "none"
        raise TrainingStopped(
            f"all {trained} iterations of this run skipped their step ({why}), so nothing was trained and the run "
            f"stopped without saving its end (last checkpoint: {last_saved}); {fix}"
        )

    def _exit_early(self, result: TrainResult, reason: str) -> TrainResult:
        """Save (unless this iteration is saved already) and stop, as Megatron's planned exits do."""
        result.iteration, result.exit_reason = self.iteration, reason
        self._settle_save(result)
        if self.config.checkpoint.save and self.saved_iteration != self.iteration:
            self._save(result)
            self._settle_save(result)
        saved = f"checkpoint {result.checkpoint}" if result.checkpoint else "nothing saved (no --save)"
        skipped = self._skipped_this_run()
        self.log.info(
            f" > exiting at iteration {self.iteration} of {self.length.train_iters}: {reason}; {saved}"
            + (f"; {skipped}" if skipped else "")
        )
        self.log.close()
        return result

    def _summary(self, result: TrainResult) -> None:
        if len(result.validation) >= 2:
            (first_it, first), (last_it, last) = result.validation[0], result.validation[-1]
            self.log.info(
                f" > validation loss {first:.4f} at iteration {first_it} -> {last:.4f} at iteration {last_it}"
            )
        if result.checkpoint:
            self.log.info(f" > checkpoint: {result.checkpoint}")
        if self.config.logging.tensorboard_dir:
            self.log.info(f" > TensorBoard logs: {self.config.logging.tensorboard_dir}")
        skipped = self._skipped_this_run()
        if skipped:  # the run's last line
            self.log.info(f" > {skipped}")


def pretrain(config: PretrainConfig, grid: ParallelGrid) -> TrainResult:
    """A training run: the one writer of its --save folder, which it locks from before the folder
    is read (a resume repairs what a crash left there) until the run ends (save_lock.py)."""
    with hold_save_lock(config.checkpoint.save, grid):
        return Trainer(config, grid).train()
