"""The settings the autotuner searches and what each is estimated to need.

A setting is a ZeRO stage, a micro-batch size (the global batch stays the flags': the accumulation
steps follow), activation checkpointing on or off, the optimizer offloaded to the CPU or not (on a
GPU only: on a CPU it moves nothing off the device) and, for an MoE model, the expert-parallel size.
The memory estimate is the model states of tools/model_size.py (weights, gradients, optimizer state
per ZeRO stage and expert-parallel size) plus the activations of one pipeline stage's in-flight
micro-batches by Korthikanti et al.'s count (s b h (34 + 5 a s / h) bytes a layer in 16 bits, twice
that in fp32; with checkpointing each layer keeps its input and one layer recomputes), plus the
logits. It leaves out the process's own memory (libraries, allocator slack): a setting near the
limit may still run out, and its trial says so in one row.
"""

import itertools
from dataclasses import dataclass, replace

from megatron.config.flags import PretrainConfig
from megatron.model.config import GPTConfig
from megatron.model_size import model_size, rank_memory, sizing_vocab, valid_ep_sizes
from megatron.runtime.config.schema import AutotuningConfig
from megatron.tokenizer_spec import tokenizer_spec_of

GB = 1024**3


@dataclass(frozen=True)
class Setting:
    zero_stage: int
    micro_batch_size: int
    checkpoint_activations: bool
    offload_optimizer: bool
    ep_size: int

    @property
    def name(self) -> str:
        return (
            f"z{self.zero_stage}_mbs{self.micro_batch_size}_ep{self.ep_size}"
            + ("_ckpt" if self.checkpoint_activations else "")
            + ("_offload" if self.offload_optimizer else "")
        )


@dataclass(frozen=True)
class Candidate:
    """A setting with its estimated bytes per rank and, when pruned, why."""

    setting: Setting
    estimated_bytes: float
    pruned: str | None = None


@dataclass(frozen=True)
class RunShape:
    """What the flags fix: the model, the layout around the searched sizes, the batch."""

    model: GPTConfig
    world_size: int
    tp_size: int
    pp_size: int
    seq_length: int
    global_batch_size: int
    bytes_per_activation: int  # 4 in fp32, 2 in fp16/bf16


def run_shape(config: PretrainConfig, world_size: int, precision: str) -> RunShape:
    t = config.training
    vocab = sizing_vocab(tokenizer_spec_of(config.data), config.data.make_vocab_size_divisible_by)
    return RunShape(
        replace(config.model, vocab_size=vocab.rows(t.tensor_parallel_size)),
        world_size,
        t.tensor_parallel_size,
        t.pipeline_parallel_size,
        t.seq_length,
        t.global_batch_size,
        4 if precision == "fp32" else 2,
    )


def activation_bytes(shape: RunShape, micro_batch: int, checkpointing: bool) -> float:
    """One pipeline stage's activations for the micro-batches 1F1B keeps in flight (pp of them on the
    first stage), per rank (tensor parallelism splits them)."""
    m, s, h, a = shape.model, shape.seq_length, shape.model.hidden_size, shape.model.num_attention_heads
    layers = m.num_layers / shape.pp_size
    per_layer = s * micro_batch * h * (34 + 5 * a * s / h) * shape.bytes_per_activation / 2
    stored = (
        (layers * 2 * s * micro_batch * h * shape.bytes_per_activation + per_layer)
        if checkpointing
        else (layers * per_layer)
    )
    logits = 2 * s * micro_batch * (m.vocab_size or 0) * 4  # fp32 logits and their gradient
    return (stored * shape.pp_size + logits) / shape.tp_size


def estimated_bytes(shape: RunShape, setting: Setting) -> float:
    size = model_size(shape.model, shape.seq_length)
    states = rank_memory(size, shape.world_size, setting.ep_size, setting.zero_stage, shape.tp_size, shape.pp_size)
    optimizer = 0.0 if setting.offload_optimizer else states.optimizer
    return (
        states.weights
        + states.gradients
        + optimizer
        + activation_bytes(shape, setting.micro_batch_size, setting.checkpoint_activations)
    )


def micro_batch_sizes(shape: RunShape, tuning: AutotuningConfig) -> list[int]:
    """Powers of two in [min, max] that divide a data-parallel rank's share of the global batch."""
    dp = shape.world_size // (shape.tp_size * shape.pp_size)
    per_rank = shape.global_batch_size // dp
    limit = tuning.max_train_micro_batch_size_per_gpu
    if tuning.max_train_batch_size is not None:
        limit = min(limit, tuning.max_train_batch_size // dp)
    sizes = [2**k for k in range(per_rank.bit_length()) if per_rank % 2**k == 0]
    return [b for b in sizes if tuning.min_train_micro_batch_size_per_gpu <= b <= limit]


def candidates(
    shape: RunShape, tuning: AutotuningConfig, stages: list[int], available_bytes: float, on_gpu: bool
) -> list[Candidate]:
    """Every setting of the grid, in grid order (stage, expert parallelism, micro-batch, then the
    memory savers), each with its estimate; those over `available_bytes` pruned. With `fast`, the
    memory savers (activation checkpointing, offload) are kept only for a stage, EP size and
    micro-batch that do not fit without them, and only the `num_tuning_micro_batch_sizes` largest
    micro-batches that fit are kept."""
    ep_sizes = valid_ep_sizes(shape.model, shape.world_size, shape.pp_size)
    savers = list(itertools.product((False, True), (False, True) if on_gpu else (False,)))
    found: list[Candidate] = []
    for stage, ep in itertools.product(stages, ep_sizes):
        row: list[Candidate] = []
        for micro in micro_batch_sizes(shape, tuning):
            for checkpointing, offload in savers:
                if offload and stage == 0:
                    continue  # DeepSpeed offloads the optimizer of ZeRO stages 1-3 only
                setting = Setting(stage, micro, checkpointing, offload, ep)
                need = estimated_bytes(shape, setting)
                pruned = (
                    f"estimated {need / GB:.2f} GB a rank > {available_bytes / GB:.2f} GB available"
                    if need > available_bytes
                    else None
                )
                row.append(Candidate(setting, need, pruned))
        found += _fast(row, tuning) if tuning.fast else row
    return found


def _fast(row: list[Candidate], tuning: AutotuningConfig) -> list[Candidate]:
    """Fast mode within one stage and EP size: a memory saver only where the plain setting does not
    fit; then the largest micro-batches that fit."""
    plain_fits = {c.setting.micro_batch_size for c in row if not _saves(c.setting) and c.pruned is None}
    kept = [c for c in row if not _saves(c.setting) or c.setting.micro_batch_size not in plain_fits]
    fitting = sorted({c.setting.micro_batch_size for c in kept if c.pruned is None})
    chosen = set(fitting[-tuning.num_tuning_micro_batch_sizes :])
    return [c for c in kept if c.pruned is not None or c.setting.micro_batch_size in chosen]


def _saves(setting: Setting) -> bool:
    return setting.checkpoint_activations or setting.offload_optimizer
