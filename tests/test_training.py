import json
import re
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from megatron.checkpoint import tensors as state_io
from megatron.checkpoint.iterations import read_latest
from megatron.checkpoint.layout import LATEST_FILE
from megatron.errors import CheckpointError, DataError
from megatron.parallel import build_parallel_grid, single_process_grid
from megatron.training import log as training_log
from megatron.training.loop import Trainer, run_summary
from tests.dist_utils import run_distributed
from tests.test_data_integrity import flip_bit
from tests.training_fixtures import tiny_config, write_corpus

SINGLE = single_process_grid(torch.device("cpu"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def test_run_summary_names_every_parallel_size_above_one(corpus):
    config = tiny_config(corpus, train_iters=60)
    grid = replace(SINGLE, world_size=8, tp_size=2, expert_tp_size=2, pp_size=2)
    summary = run_summary(config.runtime_config(1), grid)
    assert "expert-parallel 1 | tensor-parallel 2 | expert-tensor-parallel 2 | pipeline-parallel 2 | ZeRO" in summary
    assert "expert-tensor" not in run_summary(config.runtime_config(1), replace(grid, expert_tp_size=1))


def test_loss_falls_and_run_is_logged(corpus, tmp_path, capsys):
    config = tiny_config(
        corpus,
        train_iters=60,
        eval_interval=30,
        eval_at_start=True,
        lr=1e-2,
        min_lr=1e-3,
        tensorboard_dir=str(tmp_path / "tb"),
    )
    result = Trainer(config, SINGLE).train()
    (_, first), *_, (_, last) = result.validation
    # ln(60) = 4.09 is the loss of guessing uniformly among the used tokens: the model must beat it
    assert first > 4.5 and last < 3.6, result.validation
    out = capsys.readouterr().out
    assert out.startswith(
        " > run: world size 1 | data-parallel 1 | expert-parallel 1 | ZeRO stage 0 | precision fp32 | "
        "optimizer AdamW | optimizer offload none | parameter offload none | "
        "global batch 4 = micro batch 2 x accumulation 2 x data-parallel 1\n"
    )
    assert "iteration       60/      60 | consumed samples:          240 | consumed tokens:           3840" in out
    for field in (
        "lm loss:",
        "grad norm:",
        "learning rate:",
        "tokens per second:",
        "TFLOP/s:",
        "validation loss at iteration 60 | lm loss value:",
        "lm loss PPL:",
    ):
        assert field in out
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"lm loss", "learning-rate", "grad-norm", "lm loss validation"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("lm loss")] == list(range(5, 61, 5))


def test_long_work_reports_progress_when_the_log_is_quiet(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(training_log, "PROGRESS_SECONDS", 0.0)  # as if every step took longer than the limit
    Trainer(
        tiny_config(
            corpus, train_iters=2, eval_iters=2, log_interval=10, lr_warmup_iters=1, save=str(tmp_path / "ckpt")
        ),
        SINGLE,
    ).train()
    out = capsys.readouterr().out
    for line in (" > iterations done: 1/2", " > evaluation micro-batches: 4/4", " > saving checkpoint at iteration 2"):
        assert line in out
    assert re.search(r"saved checkpoint at iteration 2 to .* in \d+\.\d s", out)
    monkeypatch.setattr(training_log, "PROGRESS_SECONDS", 3600.0)
    Trainer(tiny_config(corpus, train_iters=2, eval_iters=2, log_interval=10, lr_warmup_iters=1), SINGLE).train()
    assert "iterations done" not in capsys.readouterr().out


def test_save_and_load_the_same_folder_starts_afresh_then_resumes(corpus, tmp_path, capsys):
    folder = str(tmp_path / "run")
    first = Trainer(tiny_config(corpus, train_iters=2, lr_warmup_iters=1, save=folder, load=folder), SINGLE).train()
    assert first.iteration == 2
    assert f" > WARNING: --load {folder} does not exist yet, so training starts from scratch" in capsys.readouterr().out
    Trainer(tiny_config(corpus, train_iters=4, lr_warmup_iters=1, save=folder, load=folder), SINGLE).train()
    out = capsys.readouterr().out
    assert "starts from scratch" not in out and f" > loaded checkpoint {folder}/iter_0000002 at iteration 2" in out


def test_checkpoint_layout_is_safetensors_and_json(corpus, tmp_path):
    save = tmp_path / "ckpt"
    Trainer(tiny_config(corpus, train_iters=6, save=str(save), save_interval=3), SINGLE).train()
    assert read_latest(str(save))[0] == 6
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000003", "iter_0000006", LATEST_FILE]
    files = sorted(p.name for p in (save / "iter_0000006").iterdir())
    assert files == [
        "manifest.json",
        "model_rank00000.safetensors",
        "optimizer_rank00000.safetensors",
        "rng_rank00000.safetensors",
    ]
    manifest = json.loads((save / "iter_0000006" / "manifest.json").read_text())
    assert manifest["format_version"] == 2 and sorted(manifest["files"]) == [f for f in files if f != "manifest.json"]
    run = manifest["run"]
    assert run["iteration"] == 6 and run["consumed_samples"] == 24 and run["consumed_tokens"] == 24 * 16
    assert run["model"]["hidden_size"] == 32 and run["model"]["moe"]["topk"] == 1
    assert run["tokenizer"] == {
        "tokenizer_type": "NullTokenizer",
        "tokenizer_model": None,
        "vocab_file": None,
        "merge_file": None,
        "vocab_size": 61,
        "null_tokenizer_eod": "last",
    }
    assert run["tokenizer_size"] == 61
    assert "flags" not in run and run["training_data"] == [corpus]
    assert manifest["layout"] == {
        "world_size": 1,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "data_parallel_size": 1,
        "expert_parallel_size": 1,
        "expert_tensor_parallel_size": 1,
    }
    assert (manifest["zero_stage"], manifest["precision"]) == (0, "fp32")
    assert manifest["engine"]["global_steps"] == 6 and manifest["engine"]["client_state"] == {}
    assert "exp_avg/word_embeddings.weight" in load_file(str(save / "iter_0000006" / "optimizer_rank00000.safetensors"))


def test_resume_equals_uninterrupted_run_bit_for_bit(corpus, tmp_path):
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    full = Trainer(tiny_config(corpus, train_iters=20, save=str(full_dir), save_interval=10), SINGLE)
    full_result = full.train()
    resumed_dir.mkdir()
    shutil.copytree(full_dir / "iter_0000010", resumed_dir / "iter_0000010")
    (resumed_dir / LATEST_FILE).write_text("10\n")
    torch.manual_seed(999)  # the resumed run must not depend on the RNG state before loading
    resumed = Trainer(tiny_config(corpus, train_iters=20, load=str(resumed_dir), save=str(resumed_dir)), SINGLE)
    assert resumed.iteration == 10 and resumed.consumed_samples == 40
    resumed_result = resumed.train()
    assert resumed_result.losses == full_result.losses[10:]
    for a, b in zip(full.engine.module.parameters(), resumed.engine.module.parameters()):
        assert torch.equal(a, b)


def test_crash_mid_save_leaves_previous_checkpoint_usable(corpus, tmp_path, monkeypatch):
    save = tmp_path / "ckpt"
    trainer = Trainer(tiny_config(corpus, train_iters=4, save=str(save), save_interval=2), SINGLE)
    real_save = state_io.save_tensors
    calls = {"n": 0}

    def failing_save(path, tensors, metadata=None, opener=None):
        calls["n"] += 1
        if calls["n"] > 3:  # the first checkpoint writes rng, model and optimizer; the second dies
            raise OSError("disk full")
        return real_save(path, tensors, metadata, opener)

    monkeypatch.setattr("megatron.checkpoint.save.save_tensors", failing_save)
    with pytest.raises(
        CheckpointError, match=r"saving .*iter_0000004 failed on rank 0 \(disk full\); the partial folder was removed"
    ):
        trainer.train()
    assert read_latest(str(save))[0] == 2
    assert not (save / "iter_0000004").exists() and not (save / "iter_0000004.tmp").exists()
    monkeypatch.undo()
    reloaded = Trainer(tiny_config(corpus, train_iters=4, load=str(save)), SINGLE)
    assert reloaded.iteration == 2


def test_loading_a_different_model_is_a_clear_error(corpus, tmp_path):
    save = tmp_path / "ckpt"
    Trainer(tiny_config(corpus, train_iters=3, save=str(save)), SINGLE).train()
    with pytest.raises(CheckpointError, match="saved with hidden_size 32 but this run has 64.*give --hidden-size 32"):
        Trainer(tiny_config(corpus, train_iters=3, hidden_size=64, load=str(save)), SINGLE)


def _train_and_return_parameters(corpus: str, dp_size: int) -> dict[str, torch.Tensor]:
    grid = build_parallel_grid(torch.device("cpu"))
    config = tiny_config(
        corpus,
        dp_size=dp_size,
        train_iters=6,
        micro_batch_size=1,
        global_batch_size=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    trainer = Trainer(config, grid)
    result = trainer.train()
    params = {name: p.detach().clone() for name, p in trainer.engine.module.named_parameters()}
    params["validation"] = torch.tensor([loss for _, loss in result.validation], dtype=torch.float64)
    return params


def test_two_data_parallel_ranks_equal_one(corpus):
    single = _train_and_return_parameters(corpus, 1)
    ranks = run_distributed(_train_and_return_parameters, 2, corpus, 2)
    for name, value in single.items():
        torch.testing.assert_close(ranks[0][name], ranks[1][name], rtol=0, atol=0)
        torch.testing.assert_close(ranks[0][name], value, rtol=1e-4, atol=1e-5)


def test_a_training_run_checks_its_data_unless_told_not_to(tmp_path):
    """The flag reaches the data: a flipped token bit stops a run before its first step, and
    --no-data-checksum trains on the data as it is."""
    prefix = write_corpus(tmp_path)
    flip_bit(f"{prefix}.bin", 1_000, 2)
    with pytest.raises(DataError, match=r"\.bin changed since preprocessing"):
        Trainer(tiny_config(prefix, train_iters=1, lr_warmup_iters=0), SINGLE)
    trainer = Trainer(tiny_config(prefix, train_iters=1, lr_warmup_iters=0, no_data_checksum=True), SINGLE)
    assert len(trainer.train().losses) == 1
