"""A tiny indexed corpus and flag set for end-to-end training tests."""

import json
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from megatron.checkpoint.format1 import MANIFEST_WRITER_KEYS
from megatron.checkpoint.layout import ENGINE_FILE, MANIFEST_FILE
from megatron.config.flags import PretrainConfig, parse_args, with_data_parallel_size
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype
from megatron.runtime.engine import Engine
from megatron.training.step import ForwardStep, StageForward, forward_step

VOCAB = 60


def write_corpus(folder: Path, documents: int = 200, seed: int = 0, vocab: int = VOCAB, length: int = 60) -> str:
    """Documents drawn from a fixed random bigram table, so a model can learn them quickly."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab, size=(vocab, 3))
    prefix = str(folder / "corpus_text_document")
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", best_fitting_dtype(vocab + 1), vocab_size=vocab + 1)
    for _ in range(documents):
        token = int(rng.integers(vocab))
        tokens = [token]
        for _ in range(int(rng.integers(length // 3, length))):
            token = int(successors[token, rng.integers(3)])
            tokens.append(token)
        builder.add_item(np.array(tokens + [vocab]))  # the eod of NullTokenizer --vocab-size VOCAB + 1
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def tiny_flags(data_prefix: str, **overrides: object) -> list[str]:
    flags: dict[str, object] = {
        "num-layers": 2,
        "hidden-size": 32,
        "num-attention-heads": 4,
        "seq-length": 16,
        "micro-batch-size": 2,
        "global-batch-size": 4,
        "train-iters": 20,
        "lr": 3e-3,
        "lr-warmup-iters": 2,
        "lr-decay-style": "cosine",
        "min-lr": 3e-4,
        "tokenizer-type": "NullTokenizer",
        "vocab-size": VOCAB + 1,
        "data-path": data_prefix,
        "split": "90,10,0",
        "log-interval": 5,
        "eval-interval": 10,
        "eval-iters": 2,
        "num-workers": 0,
        "hidden-dropout": 0.1,
        "attention-dropout": 0.1,
    }
    flags.update({key.replace("_", "-"): value for key, value in overrides.items()})
    argv: list[str] = []
    for key, value in flags.items():
        if value is False or value is None:
            continue
        argv.append(f"--{key}")
        if isinstance(value, (list, tuple)):
            argv += [str(item) for item in value]
        elif value is not True:
            argv.append(str(value))
    return argv


def moe_layout_flags(data_prefix: str, pp: int = 1, ep: int = 1, **overrides: object) -> list[str]:
    """tiny_flags for a 4-expert MoE GPT over `pp` pipeline stages and `ep` expert-parallel ranks:
    one sample a micro-batch, no dropout, evaluation only at the end."""
    layout: dict[str, object] = {
        "num_experts": 4,
        "moe_expert_parallel_size": ep,
        "pipeline_model_parallel_size": pp,
        "micro_batch_size": 1,
        "global_batch_size": 4,
        "eval_interval": 100,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    }
    return tiny_flags(data_prefix, **{**layout, **overrides})


# today's MoE architecture, for tests that check it composes with a feature: SwiGLU bias-free fine-grained and
# shared experts, sigmoid routing with expert bias, RMSNorm, GQA, rope, an untied output layer
MODERN_MOE = {
    "num_experts": 4,
    "topk": 2,
    "swiglu": True,
    "disable_bias_linear": True,
    "moe_ffn_hidden_size": 16,
    "moe_shared_expert_intermediate_size": 16,
    "moe_router_score_function": "sigmoid",
    "moe_router_enable_expert_bias": True,
    "normalization": "RMSNorm",
    "group_query_attention": True,
    "num_query_groups": 2,
    "position_embedding_type": "rope",
    "untie_embeddings_and_output_weights": True,
}


def tiny_config(data_prefix: str, dp_size: int = 1, **overrides: object) -> PretrainConfig:
    return with_data_parallel_size(parse_args(tiny_flags(data_prefix, **overrides)), dp_size)


def poisoned_forward(factor: float, where: Callable[[Engine], bool]) -> ForwardStep:
    """The trainer's forward step with the LM loss multiplied by `factor` (NaN, inf) wherever
    `where(engine)` holds: the fault a `Trainer(..., forward=...)` test injects."""

    def forward(engine: Engine, *args: object, **kwargs: object) -> StageForward:
        step = forward_step(engine, *args, **kwargs)
        if not where(engine):
            return step
        return replace(step, losses=replace(step.losses, lm=step.losses.lm * factor))

    return forward


def wait_for_line(process: subprocess.Popen, text: str) -> list[str]:
    """The lines a training subprocess printed up to the first that holds `text`."""
    lines = []
    for line in process.stdout:
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"the run ended before printing {text!r}:\n{''.join(lines)}")


# A checkpoint saved in format 1 (manifest.json beside engine.json) by the toolkit at ba01e63, committed so
# that the format-1 reader stays tested: iteration 2 of a 4-iteration run on write_corpus(documents=40),
# NullTokenizer, layer 2 of 2 an MoE layer; expected.json holds that code's losses of iterations 3-4
# and its validation loss at 4, resumed from it. tests/fixtures/checkpoint_format1/README.md says more.
FORMAT1_CHECKPOINT = Path(__file__).resolve().parent / "fixtures" / "checkpoint_format1"
FORMAT1_FLAGS = {
    "num_layers": 2,
    "hidden_size": 16,
    "num_attention_heads": 2,
    "num_experts": 2,
    "lr_warmup_iters": 1,
    "lr_decay_iters": 4,
    "micro_batch_size": 2,
    "global_batch_size": 2,
    "eval_interval": 100,
    "log_interval": 1,
}


def format1_checkpoint(folder: Path) -> Path:
    """A writable copy of the format-1 checkpoint directory in `folder`."""
    shutil.copytree(FORMAT1_CHECKPOINT, folder, ignore=shutil.ignore_patterns("expected.json", "README.md"))
    return folder


def as_saved_before_manifests(folder: Path) -> None:
    """A format-1 iteration folder as saved before manifests existed: no manifest, and none of the
    keys engine.json has held since manifests were written."""
    (folder / MANIFEST_FILE).unlink()
    meta = json.loads((folder / ENGINE_FILE).read_text())
    (folder / ENGINE_FILE).write_text(
        json.dumps({key: value for key, value in meta.items() if key not in MANIFEST_WRITER_KEYS}, indent=1)
    )
