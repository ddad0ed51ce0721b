"""DeepSpeed's legacy curriculum learning by sequence length: each schedule's length at chosen
steps equals DeepSpeed's CurriculumScheduler written out here from its documentation (a stateful
update_difficulty loop), a training run's batches follow the schedule with the tokens, the log and
the LR schedule counting the shorter sequences, and a resumed run continues it exactly."""

import json
import math
import re
import shutil

import pytest
import torch

from megatron.checkpoint.layout import LATEST_FILE
from megatron.config.flags import parse_args
from megatron.errors import ConfigError
from megatron.parallel import single_process_grid
from megatron.runtime.config.schema import CurriculumLearningConfig, load_runtime_config
from megatron.training.curriculum import CurriculumSchedule
from megatron.training.loop import Trainer
from megatron.training.step import forward_step
from tests.training_fixtures import tiny_flags, write_corpus

SINGLE = single_process_grid(torch.device("cpu"))


def deepspeed_lengths(block: dict, steps: int) -> list[int]:
    """DeepSpeed's CurriculumScheduler as its documentation gives it: the difficulty starts at
    min_difficulty and, before each step's forward, while below max_difficulty, becomes the
    schedule's value at the step (global_steps + 1)."""
    s, lo, hi = block["schedule_config"], block["min_difficulty"], block["max_difficulty"]

    def value(step: int) -> int:
        if block["schedule_type"] == "fixed_discrete":
            if step > s["max_step"][-1]:
                return s["difficulty"][-1]
            return next(d for d, last in zip(s["difficulty"], s["max_step"]) if step <= last)
        root = s.get("root_degree", 1) if block["schedule_type"] == "fixed_root" else 1
        length = math.floor((step / s["total_curriculum_step"]) ** (1 / root) * (hi - lo) + lo)
        return min(length - length % s["difficulty_step"], hi)

    current, lengths = lo, []
    for step in range(1, steps + 1):
        if current < hi:
            current = value(step)
        lengths.append(current)
    return lengths


SCHEDULES = {
    "fixed_linear": {"total_curriculum_step": 10, "difficulty_step": 8},
    "fixed_root": {"total_curriculum_step": 10, "difficulty_step": 8, "root_degree": 2},
    "fixed_discrete": {"difficulty": [16, 32, 64], "max_step": [3, 6]},
}


@pytest.mark.parametrize("kind", SCHEDULES)
def test_each_schedules_lengths_are_deepspeeds(kind):
    block = {"enabled": True, "min_difficulty": 8, "max_difficulty": 64, "schedule_type": kind}
    block["schedule_config"] = SCHEDULES[kind]
    curriculum = CurriculumSchedule(CurriculumLearningConfig(**block))
    got = [curriculum.difficulty(step) for step in range(1, 31)]
    assert got == deepspeed_lengths(block, 30)
    # a few written out: linear 8 + 56 i / 10 less its remainder by 8; root with sqrt(i / 10)
    expected = {"fixed_linear": [8, 24, 24, 64], "fixed_root": [24, 32, 40, 64], "fixed_discrete": [16, 16, 32, 64]}
    assert [got[i - 1] for i in (1, 3, 4, 10)] == expected[kind]


def test_a_discrete_list_that_reaches_the_maximum_holds_it_as_deepspeed_does():
    block = {"enabled": True, "min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_discrete"}
    block["schedule_config"] = {"difficulty": [8, 64, 16], "max_step": [2, 4]}
    curriculum = CurriculumSchedule(CurriculumLearningConfig(**block))
    assert [curriculum.difficulty(step) for step in range(1, 9)] == deepspeed_lengths(block, 8) == [8, 8] + [64] * 6


@pytest.mark.parametrize(
    "block, message",
    [
        ({"schedule_type": "custom"}, "schedule_type custom needs a Python schedule function"),
        ({"schedule_type": "fixed_root", "schedule_config": {"total_curriculum_step": 5, "difficulty_step": 8}},
         "schedule_type fixed_root needs schedule_config.root_degree"),
        ({"schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [8, 16], "max_step": [2, 4]}},
         "difficulty has 2 values and max_step 2"),
        ({"min_difficulty": 4, "schedule_config": {"total_curriculum_step": 5, "difficulty_step": 8}},
         "min_difficulty 4 is not a multiple of schedule_config.difficulty_step 8"),
        ({"curriculum_type": "vocabularyrarity"}, "curriculum_learning.curriculum_type"),
        ({"schedule_config": {"total_curriculum_step": 5, "difficulty_step": 8, "bogus": 1}},
         "curriculum_learning.schedule_config.bogus"),
    ],
)  # fmt: skip
def test_bad_curriculum_blocks_are_refused_by_name(block, message):
    with pytest.raises(ConfigError, match=message):
        load_runtime_config({"train_batch_size": 2, "curriculum_learning": {"enabled": True, **block}}, 1)


def _config(tmp_path, corpus, block, **overrides):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"curriculum_learning": block}))
    flags = tiny_flags(corpus, micro_batch_size=2, global_batch_size=4, hidden_dropout=0.0, attention_dropout=0.0,
                       **overrides)  # fmt: skip
    return parse_args(flags + ["--curriculum-learning-legacy", "--deepspeed", "--deepspeed_config", str(ds)])


BLOCK = {
    "enabled": True,
    "curriculum_type": "seqlen",
    "min_difficulty": 4,
    "max_difficulty": 16,
    "schedule_type": "fixed_linear",
    "schedule_config": {"total_curriculum_step": 6, "difficulty_step": 4},
}


def test_a_run_trains_on_the_schedules_lengths_counts_their_tokens_and_resumes_exactly(tmp_path, capsys):
    corpus = write_corpus(tmp_path)
    lengths: list[int] = []

    def recording(engine, batch, *args, **kwargs):
        if engine.module.training:
            lengths.append(batch.tokens_BS.shape[1])
        return forward_step(engine, batch, *args, **kwargs)

    full_dir = tmp_path / "full"
    config = _config(tmp_path, corpus, BLOCK, train_iters=10, save=str(full_dir), save_interval=5, log_interval=5)
    full = Trainer(config, SINGLE, forward=recording)
    result = full.train()
    schedule = [min(16, math.floor(i / 6 * 12 + 4) // 4 * 4) for i in range(1, 11)]  # fixed_linear, step 4
    assert lengths == [length for length in schedule for _ in range(2)]  # two micro-batches an iteration
    assert full.consumed_tokens == 4 * sum(schedule) and full.consumed_samples == 40
    assert full.engine.lr_scheduler.num_steps == 4 * sum(schedule)  # the LR counts the tokens trained
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(" iteration")]
    assert re.search(r"consumed tokens: +" + str(4 * sum(schedule[:5])) + " ", lines[0])
    # resumed at iteration 5: the same lengths, losses and weights as the uninterrupted run
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(full_dir / "iter_0000005", resumed_dir / "iter_0000005")
    (resumed_dir / LATEST_FILE).write_text("5\n")
    lengths.clear()
    config = _config(
        tmp_path, corpus, BLOCK, train_iters=10, load=str(resumed_dir), save=str(resumed_dir), log_interval=5
    )
    resumed = Trainer(config, SINGLE, forward=recording)
    assert resumed.consumed_tokens == 4 * sum(schedule[:5])
    assert resumed.train().losses == result.losses[5:]
    assert lengths == [length for length in schedule[5:] for _ in range(2)]
    for a, b in zip(full.engine.module.parameters(), resumed.engine.module.parameters()):
        assert torch.equal(a, b)


def test_train_tokens_counts_the_cut_sequences_and_the_lr_decays_over_them(tmp_path):
    """Megatron-DeepSpeed stops once the tokens trained reach --train-tokens: under a curriculum that
    is more iterations than whole sequences would need, known before the run from the schedule."""
    corpus = write_corpus(tmp_path)
    schedule = [min(16, math.floor(i / 6 * 12 + 4) // 4 * 4) for i in range(1, 30)]
    budget = 4 * sum(schedule[:8]) - 1  # reached within iteration 8
    trainer = Trainer(_config(tmp_path, corpus, BLOCK, train_iters=None, train_tokens=budget), SINGLE)
    trainer.train()
    assert trainer.iteration == 8 and trainer.consumed_tokens == 4 * sum(schedule[:8])
    scheduler = trainer.engine.lr_scheduler  # the default decay covers the run's counted tokens
    assert scheduler.num_steps == scheduler.decay_steps == 4 * sum(schedule[:8])
    assert -(-budget // 64) < 8  # whole sequences (64 tokens an iteration) would have stopped earlier
    capped = Trainer(_config(tmp_path, corpus, BLOCK, train_iters=5, train_tokens=budget), SINGLE)
    capped.train()
    assert capped.iteration == 5  # --train-iters came first


def test_the_run_refuses_what_the_curriculum_cannot_do(tmp_path):
    corpus = write_corpus(tmp_path)
    with pytest.raises(ConfigError, match="max_difficulty 32 is above --seq-length 16"):
        Trainer(_config(tmp_path, corpus, {**BLOCK, "max_difficulty": 32}), SINGLE)
    ds = tmp_path / "off.json"
    ds.write_text("{}")
    flags = tiny_flags(corpus) + ["--curriculum-learning-legacy", "--deepspeed", "--deepspeed_config", str(ds)]
    with pytest.raises(ConfigError, match="--curriculum-learning-legacy needs the ds_config curriculum_learning block"):
        Trainer(parse_args(flags), SINGLE)
