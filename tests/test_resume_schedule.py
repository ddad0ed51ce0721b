"""Resuming a tiny GPT run under another LR schedule: from a DeepSpeed `scheduler` block to
Megatron's annealing flags and back, and with a changed decay length. The resumed run's LRs
are checked against the schedules' formulas, written out again here."""

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from megatron.config.flags import parse_args, with_data_parallel_size
from megatron.parallel import single_process_grid
from megatron.training.loop import Trainer
from tests.training_fixtures import tiny_flags, write_corpus

SINGLE = single_process_grid(torch.device("cpu"))
TOKENS = 4 * 16  # global batch x sequence length: the annealing schedule counts tokens
MAX_LR, MIN_LR, WARMUP = 3e-3, 3e-4, 2  # tiny_flags' --lr, --min-lr, --lr-warmup-iters (cosine decay)
DECAY_LR = {
    "total_num_steps": 12,
    "warmup_min_lr": 0.0,
    "warmup_max_lr": MAX_LR,
    "warmup_num_steps": WARMUP,
    "warmup_type": "linear",
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def annealing_lr(iteration: int, decay_iters: int) -> float:
    """Megatron's cosine annealing after `iteration` steps."""
    tokens, warmup, decay = iteration * TOKENS, WARMUP * TOKENS, decay_iters * TOKENS
    if tokens <= warmup:
        return MAX_LR * tokens / warmup
    if tokens > decay:
        return MIN_LR
    ratio = (tokens - warmup) / (decay - warmup)
    return MIN_LR + 0.5 * (math.cos(math.pi * ratio) + 1) * (MAX_LR - MIN_LR)


def warmup_decay_lr(iteration: int) -> float:
    """DeepSpeed's WarmupDecayLR (linear warmup) for optimizer step `iteration`, which runs at t = iteration - 1."""
    t, total = iteration - 1, DECAY_LR["total_num_steps"]
    if t < 0:
        return 0.0
    return MAX_LR * (t / WARMUP if t < WARMUP else max(0.0, (total - t) / (total - WARMUP)))


def deepspeed_flags(corpus: str, folder: Path, **overrides: object) -> list[str]:
    """tiny_flags with a DeepSpeed WarmupDecayLR block in place of Megatron's annealing flags."""
    config = folder / "ds.json"
    config.write_text(json.dumps({"scheduler": {"type": "WarmupDecayLR", "params": DECAY_LR}}))
    flags = tiny_flags(corpus, **overrides)
    for flag in ("--lr-warmup-iters", "--lr-decay-style", "--min-lr"):
        index = flags.index(flag)
        del flags[index : index + 2]
    return flags + ["--deepspeed", "--deepspeed_config", str(config)]


def train(flags: list[str]) -> list[float]:
    """Train; the LR each optimizer step ran with."""
    trainer = Trainer(with_data_parallel_size(parse_args(flags), 1), SINGLE)
    lrs: list[float] = []
    trainer.engine.optimizer.register_step_pre_hook(lambda optimizer, *_: lrs.append(optimizer.param_groups[0]["lr"]))
    trainer.train()
    return lrs


def resume_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("resuming:")]


class Source(NamedTuple):
    name: str  # as the resume line names it
    lr: Callable[[int], float]  # the LR optimizer step k runs with
    deepspeed: bool


ANNEALING = Source("Megatron's LR annealing (flags)", lambda k: annealing_lr(k, 12), deepspeed=False)
DEEPSPEED = Source("DeepSpeed's WarmupDecayLR (config scheduler block)", warmup_decay_lr, deepspeed=True)


@pytest.mark.parametrize("saved_with,resumed_with", [(DEEPSPEED, ANNEALING), (ANNEALING, DEEPSPEED)])
def test_resume_under_the_other_kind_of_schedule_continues_at_the_step_count(
    corpus: str,
    tmp_path: Path,
    capsys,
    saved_with: Source,
    resumed_with: Source,
) -> None:
    def flags(source: Source, **overrides: object) -> list[str]:
        if source.deepspeed:
            return deepspeed_flags(corpus, tmp_path, **overrides)
        return tiny_flags(corpus, lr_decay_iters=12, **overrides)

    save = str(tmp_path / "ckpt")
    saved = train(flags(saved_with, train_iters=6, save=save, save_interval=6))
    assert saved == pytest.approx([saved_with.lr(k) for k in range(6)], abs=1e-12)
    capsys.readouterr()
    resumed = train(flags(resumed_with, train_iters=12, load=save))
    assert resumed == pytest.approx([resumed_with.lr(k) for k in range(6, 12)], abs=1e-12)
    assert resume_lines(capsys) == [
        f"resuming: the LR schedule changed kind from {saved_with.name} in the checkpoint to {resumed_with.name}, "
        "which continues after the checkpoint's 6 optimizer steps; "
        f"the LR jumps from {saved_with.lr(6):.2e} to {resumed_with.lr(6):.2e}"
    ]


def test_longer_training_says_the_decay_stretched_and_the_hint_keeps_it(corpus: str, tmp_path: Path, capsys) -> None:
    save = str(tmp_path / "ckpt")
    train(tiny_flags(corpus, train_iters=6, save=save, save_interval=6))  # decays over the 6 iterations
    capsys.readouterr()
    stretched = train(tiny_flags(corpus, train_iters=8, load=save))  # the new flags win: decay over 8
    assert stretched == pytest.approx([annealing_lr(k, 8) for k in (6, 7)], abs=1e-12)
    assert resume_lines(capsys) == [
        "resuming: the LR schedule's decay length changed from 6 to 8 iterations (checkpoint -> flags); "
        f"the LR jumps from {MIN_LR:.2e} to {annealing_lr(6, 8):.2e}; pass --lr-decay-iters 6 to keep the checkpoint's"
    ]
    kept = train(tiny_flags(corpus, train_iters=8, lr_decay_iters=6, load=save))
    assert kept == pytest.approx([MIN_LR, MIN_LR], abs=1e-12) and resume_lines(capsys) == []
