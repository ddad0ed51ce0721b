"""Runs left alone: the non-finite policy (NaN injected at a chosen iteration in fp32, bf16 and
fp16, on one and two ranks), checkpoints that refuse non-finite state, and planned exits (a real
SIGTERM during training and during a save, on one and two ranks; --exit-interval;
--exit-duration-in-mins; SIGTERM without the handler)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.checkpoint.iterations import read_latest
from megatron.checkpoint.layout import LATEST_FILE
from megatron.errors import CheckpointError, TrainingStopped
from megatron.parallel import build_parallel_grid, free_port, single_process_grid
from megatron.training.loop import Trainer
from megatron.training.step import ForwardStep
from tests.dist_utils import run_distributed
from tests.training_fixtures import poisoned_forward, tiny_config, tiny_flags, wait_for_line, write_corpus

SINGLE = single_process_grid(torch.device("cpu"))
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _nan_loss_at(iteration: int, rank: int | None = None) -> ForwardStep:
    """A forward step whose LM loss is NaN during `iteration` (on `rank` only, if given) and from then on."""
    return poisoned_forward(
        float("nan"), lambda engine: engine.global_steps + 1 >= iteration and rank in (None, engine.parallel.rank)
    )


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_a_nan_loss_in_fp32_or_bf16_stops_the_run_naming_iteration_and_rank(corpus, tmp_path, precision):
    save = tmp_path / "ckpt"
    trainer = Trainer(
        tiny_config(corpus, train_iters=6, save=str(save), save_interval=1, **({precision: True} if precision else {})),
        SINGLE,
        forward=_nan_loss_at(3),
    )
    with pytest.raises(
        TrainingStopped,
        match=r"iteration 3: the loss is not finite on rank 0 and the gradient norm is "
        r"not finite on rank 0, so the run stopped without saving \(last "
        r"checkpoint: iteration 2\)",
    ):
        trainer.train()
    assert read_latest(str(save))[0] == 2
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000001", "iter_0000002", LATEST_FILE]


def test_fp16_skips_an_overflowing_step_and_reports_it(corpus, tmp_path, capsys):
    result = Trainer(
        tiny_config(
            corpus,
            train_iters=5,
            fp16=True,
            log_interval=5,
            initial_loss_scale=256,
            tensorboard_dir=str(tmp_path / "tb"),
        ),
        SINGLE,
        forward=poisoned_forward(float("inf"), lambda engine: engine.global_steps == 2),
    ).train()
    assert result.iteration == 5
    assert "number of skipped iterations:   1" in capsys.readouterr().out
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("skipped-iterations")] == [1.0]


def test_fp16_stops_after_too_many_skipped_steps_in_a_row(corpus, tmp_path):
    trainer = Trainer(
        tiny_config(corpus, train_iters=10, fp16=True, initial_loss_scale=256, max_consecutive_skipped_iterations=3),
        SINGLE,
        forward=_nan_loss_at(2),
    )
    with pytest.raises(TrainingStopped, match="iteration 4: the last 3 iterations all skipped their step"):
        trainer.train()


def test_nan_weights_are_never_saved_and_latest_never_moves(corpus, tmp_path):
    save = tmp_path / "ckpt"
    trainer = Trainer(
        tiny_config(corpus, train_iters=4, save=str(save), save_interval=2, no_check_for_nan_in_loss_and_grad=True),
        SINGLE,
    )
    with torch.no_grad():  # a weight that is NaN from the start: every step is skipped and it stays NaN
        next(trainer.engine.module.parameters()).view(-1)[0] = float("nan")
    with pytest.raises(
        CheckpointError,
        match=r"holds a NaN or an infinity on rank 0, so .*iter_0000002 was not written "
        "and the latest checkpoint is unchanged",
    ):
        trainer.train()
    assert not save.exists() or sorted(p.name for p in save.iterdir()) == []


def _nan_on_rank_one(corpus: str) -> dict[str, torch.Tensor]:
    trainer = Trainer(
        tiny_config(corpus, dp_size=2, train_iters=4, global_batch_size=4),
        build_parallel_grid(torch.device("cpu")),
        forward=_nan_loss_at(2, rank=1),
    )
    try:
        trainer.train()
    except TrainingStopped as stopped:
        return {"message": torch.tensor(list(str(stopped).encode()), dtype=torch.uint8)}
    return {"message": torch.zeros(0, dtype=torch.uint8)}


def test_a_nan_on_one_of_two_ranks_stops_both_naming_that_rank(corpus):
    messages = [bytes(r["message"].tolist()).decode() for r in run_distributed(_nan_on_rank_one, 2, corpus)]
    for message in messages:
        assert message.startswith("iteration 2: the loss is not finite on rank 1 and the gradient norm is not finite")


def test_exit_interval_and_duration_save_and_stop(corpus, tmp_path, capsys):
    save = tmp_path / "interval"
    result = Trainer(tiny_config(corpus, train_iters=10, save=str(save), exit_interval=3), SINGLE).train()
    assert (result.iteration, result.exit_reason) == (3, "--exit-interval 3") and read_latest(str(save))[0] == 3
    assert "exiting at iteration 3 of 10: --exit-interval 3; checkpoint" in capsys.readouterr().out
    save = tmp_path / "duration"
    result = Trainer(tiny_config(corpus, train_iters=10, save=str(save), exit_duration_in_mins=1e-6), SINGLE).train()
    assert result.iteration == 1 and "past --exit-duration-in-mins" in result.exit_reason
    assert read_latest(str(save))[0] == 1


# patches the save so that the process sends itself SIGTERM in the middle of its first save
SIGTERM_DURING_SAVE = """
import os, signal, sys
import megatron.checkpoint.save as save
real, sent = save.fsync_path, []
def fsync_and_signal(path):
    if not sent:
        sent.append(os.kill(os.getpid(), signal.SIGTERM))
    real(path)
save.fsync_path = fsync_and_signal
from megatron.cli.pretrain_gpt import main
main(sys.argv[1:])
"""


def _launch(flags: list[str], world: int, script: str | None = None) -> list[subprocess.Popen]:
    """`world` processes of pretrain_gpt.py (or `script`) as torchrun would start them."""
    port = free_port()
    command = [sys.executable, "-c", script] if script else [sys.executable, str(REPO / "pretrain_gpt.py")]
    processes = []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if world > 1:
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        processes.append(
            subprocess.Popen(
                command + flags, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    return processes


@pytest.mark.parametrize("world", [1, 2])
def test_sigterm_during_training_saves_and_exits_zero_on_every_rank(corpus, tmp_path, world):
    save = tmp_path / "ckpt"
    flags = tiny_flags(
        corpus,
        train_iters=100000,
        log_interval=1,
        eval_interval=100000,
        save=str(save),
        exit_signal_handler=True,
        global_batch_size=4,
    )
    processes = _launch(flags, world)
    seen = wait_for_line(processes[0], "iteration        3/")
    processes[-1].send_signal(signal.SIGTERM)  # one rank only: all must agree
    outputs = ["".join(seen) + processes[0].stdout.read()] + [p.stdout.read() for p in processes[1:]]
    assert [p.wait(timeout=120) for p in processes] == [0] * world, outputs
    iteration = read_latest(str(save))[0]
    assert f"exiting at iteration {iteration} of 100000: received SIGTERM (--exit-signal-handler)" in outputs[0]
    manifest = json.loads((save / f"iter_{iteration:07d}" / "manifest.json").read_text())
    assert manifest["layout"]["world_size"] == world and f"rng_rank{world - 1:05d}.safetensors" in manifest["files"]


@pytest.mark.parametrize("world", [1, 2])
def test_sigterm_during_a_save_finishes_it_then_exits_zero(corpus, tmp_path, world):
    save = tmp_path / "ckpt"
    flags = tiny_flags(
        corpus, train_iters=50, save=str(save), save_interval=2, exit_signal_handler=True, global_batch_size=4
    )
    processes = _launch(flags, world, SIGTERM_DURING_SAVE)
    outputs = [p.communicate(timeout=180)[0] for p in processes]
    assert [p.returncode for p in processes] == [0] * world, outputs
    assert "exiting at iteration 3 of 50: received SIGTERM" in outputs[0]
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000002", "iter_0000003", LATEST_FILE]
    assert Trainer(tiny_config(corpus, train_iters=50, load=str(save)), SINGLE).iteration == 3


def test_sigterm_without_the_handler_exits_at_once_and_removes_the_swap_folder(corpus, tmp_path):
    nvme = tmp_path / "nvme"
    config = tmp_path / "ds.json"
    config.write_text(
        json.dumps({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}}})
    )
    flags = tiny_flags(
        corpus, train_iters=100000, log_interval=1, eval_interval=100000, deepspeed=True, deepspeed_config=str(config)
    )
    (process,) = _launch(flags, 1)
    seen = wait_for_line(process, "iteration        2/")
    assert any(nvme.iterdir()), "the run swaps through a folder under nvme_path"
    process.send_signal(signal.SIGTERM)
    output = "".join(seen) + process.stdout.read()
    assert process.wait(timeout=60) == 128 + signal.SIGTERM, output
    assert list(nvme.iterdir()) == [], output
