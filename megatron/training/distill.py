"""Mixture-of-Students (MoS) knowledge distillation: the teacher and what it adds to training.

The teacher is its own `GPTModel` with its own config, read from its checkpoint (the
`--*-teacher` flags only check it), loaded weights-only with any expert-parallel size. It runs
in eval mode under no_grad and MoE-dropless, so its targets for a token depend on that token's
text alone, never on which micro-batch it shares: 4 micro-batches x 1 equals 1 x 4 and EP=N
equals EP=1 with the KD term on, as without it. The student's loss while KD is on:

    alpha * LM cross entropy + MoE aux loss + beta * T^2 * KL(softmax(teacher/T) || softmax(student/T))

Legend: B batch, S sequence, V (padded) vocabulary.
"""

from pathlib import Path

import torch

from megatron.checkpoint.iterations import read_latest
from megatron.checkpoint.layout import LATEST_FILE
from megatron.checkpoint.reader import build_saved_model, saved_run
from megatron.checkpoint.tensors import ShardedReader
from megatron.config.distill_flags import DistillConfig
from megatron.errors import CheckpointError, ConfigError
from megatron.inference.mode import inference_config
from megatron.model import GPTConfig, GPTModel
from megatron.model.tensor_parallel import TensorParallel
from megatron.parallel import ParallelGrid
from megatron.placement import expert_ids, local_part


def teacher_checkpoint(
    cfg: DistillConfig, student: GPTConfig, seq_length: int, grid: ParallelGrid
) -> tuple[Path, GPTConfig]:
    """The teacher's checkpoint folder and saved config, checked against the teacher flags and the
    student (vocabulary, positions, expert-parallel size) before anything is built."""
    if read_latest(cfg.load_teacher)[0] is None:
        raise CheckpointError(
            f"--load-teacher {cfg.load_teacher} holds no checkpoint (no {LATEST_FILE}); "
            "pass the --save directory of the teacher's training run"
        )
    record = saved_run(cfg.load_teacher, grid)
    folder, saved = record.folder, record.run.model
    wrong = cfg.teacher.mismatches(saved)
    if wrong:
        raise ConfigError(
            f"the teacher checkpoint {folder} does not match the teacher flags ({'; '.join(wrong)}); "
            "fix the --*-teacher flags or --load-teacher"
        )
    teacher_tokenizer = record.run.tokenizer.tokenizer_type
    if saved.vocab_size != student.vocab_size:
        raise ConfigError(
            f"the teacher's vocabulary has {saved.vocab_size} (padded) entries from its {teacher_tokenizer} but the "
            f"student's has {student.vocab_size}; train the student with the teacher's tokenizer flags"
            + (
                " and a --make-vocab-size-divisible-by that pads the vocabulary to the teacher's at this "
                "--tensor-model-parallel-size"
                if grid.tp_size > 1
                else ""
            )
        )
    if saved.position_embedding_type == "learned_absolute" and saved.max_position_embeddings < seq_length:
        raise ConfigError(
            f"the teacher has {saved.max_position_embeddings} positions but --seq-length is {seq_length}; "
            f"use a --seq-length of at most {saved.max_position_embeddings}"
        )
    uneven = [count for count in saved.experts_per_layer if count > 1 and count % grid.ep_size]
    if uneven:
        raise ConfigError(
            f"the teacher's {uneven[0]} experts cannot be split over --moe-expert-parallel-size {grid.ep_size}; "
            "choose an expert-parallel size that divides every teacher and student layer's expert count"
        )
    return folder, saved


def load_teacher(
    folder: Path, saved: GPTConfig, grid: ParallelGrid, dtype: torch.dtype | None, tp: TensorParallel = TensorParallel()
) -> GPTModel:
    """The frozen teacher on `grid`, in eval mode, dropless, split as the student is (`tp`); in
    `dtype` when training in half precision (it is never updated, so it needs no fp32 master copy)."""
    teacher = build_saved_model(folder, inference_config(saved), grid, tp).requires_grad_(False)
    return teacher.to(dtype) if dtype is not None else teacher


def _global_shapes(config: GPTConfig) -> dict[str, torch.Size]:
    """Every state entry's shape with all experts present (a meta-device build: no memory)."""
    with torch.device("meta"):
        return {name: tensor.shape for name, tensor in GPTModel(config).state_dict().items()}


# options under which a tensor of the same name and shape means something else: SwiGLU's first MLP
# weight holds gate and up halves, the grouped QKV layout interleaves the heads by query group
# (the same shape as the plain layout when every head is its own group), the norms and positions
# scale and rotate what the weights see
MEANING_FIELDS = ("swiglu", "normalization", "position_embedding_type", "rotary_percent", "rotary_base")


def _meaning_differences(student: GPTConfig, teacher: GPTConfig) -> list[str]:
    differences = student.differences(teacher, MEANING_FIELDS)
    if (student.num_query_groups is None) != (teacher.num_query_groups is None):
        differences.append("grouped-query attention's QKV layout on one side only")
    return differences


def init_student_from_teacher(student: GPTModel, folder: Path, teacher: GPTConfig) -> str:
    """Copy into `student` every teacher tensor of the same name and shape: the embeddings, the
    final layernorm and the layers the student has (layer i from teacher layer i), minus the
    parts whose shapes differ (another expert count, say). Returns the log line saying which.
    Refused where the two models' options give same-shaped tensors different meanings."""
    differences = _meaning_differences(student.config, teacher)
    if differences:
        raise ConfigError(
            f"--mos-init-from-teacher copies tensors by name and shape, but the teacher in {folder} is "
            f"built differently ({'; '.join(differences)}); give the student the teacher's model "
            "options or drop --mos-init-from-teacher"
        )
    teacher_shapes = _global_shapes(teacher)
    taken = {name for name, shape in _global_shapes(student.config).items() if teacher_shapes.get(name) == shape}
    if not taken:
        raise ConfigError(
            f"no student weight has the shape of the teacher's in {folder}; "
            "--mos-init-from-teacher needs the same hidden size and vocabulary, drop it otherwise"
        )
    reader = ShardedReader(folder, "model")
    whole, partly = [], []
    with torch.no_grad():
        for name, tensor in student.state_dict(keep_vars=True).items():
            if name in taken:
                tensor.copy_(local_part(tensor, reader.get_global(name, expert_ids(tensor))))
        for key, layer in student.layers.named_children():  # global layer indices, also on a pipeline stage
            index = int(key)
            names = [f"layers.{index}.{name}" for name in layer.state_dict()]
            copied = sum(name in taken for name in names)
            (whole if copied == len(names) else partly if copied else []).append(index + 1)
    others = sorted({name.split(".")[0] for name in taken if not name.startswith("layers.")})
    unused = range(student.config.num_layers + 1, teacher.num_layers + 1)
    parts = [
        ", ".join(others),
        f"layers {_spans(whole)} whole" if whole else "",
        f"layers {_spans(partly)} partly (tensors of another shape, such as another expert count, stay fresh)"
        if partly
        else "",
        f"teacher layers {_spans(list(unused))} unused" if unused else "",
    ]
    return f" > student initialised from the teacher {folder}: " + "; ".join(part for part in parts if part)


def _spans(numbers: list[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans)
