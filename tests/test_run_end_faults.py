"""How a run ends, tried for real on tiny models: an fp16 run that skipped every step (a static loss
scale of 1e30) stops non-zero with one sentence and saves nothing at its end; one that skipped some
says how many on its last line; a finished run started again says it is complete; and the first log
line after a resume averages the same iterations as the uninterrupted run's line."""

import json
import re
import shutil

import pytest
import torch

from megatron.checkpoint.iterations import read_latest
from megatron.checkpoint.layout import LATEST_FILE, MANIFEST_FILE, iteration_tag
from megatron.entry_point import run_entry_point
from megatron.parallel import single_process_grid
from megatron.training.loop import Trainer, pretrain
from tests.training_fixtures import tiny_config, write_corpus

SINGLE = single_process_grid(torch.device("cpu"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def test_an_fp16_run_that_skipped_every_step_exits_non_zero_with_one_sentence(corpus, tmp_path, capsys):
    save = tmp_path / "ckpt"
    config = tiny_config(corpus, train_iters=6, fp16=True, loss_scale=1e30, save=str(save))
    with pytest.raises(SystemExit) as stopped:
        run_entry_point(lambda: pretrain(config, SINGLE))
    assert stopped.value.code == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: all 6 iterations of this run skipped their step (the gradient norm is not finite")
    assert "at the static fp16 loss scale 1e+30), so nothing was trained and the run stopped without saving" in line
    assert line.endswith("lower --loss-scale or leave it out to scale dynamically, or train in bf16")
    assert list(save.iterdir()) == []  # no checkpoint of an untrained model at "iteration 6" (and no lock left)


def test_a_run_that_skipped_some_steps_says_how_many_on_its_last_line(corpus, tmp_path, capsys):
    # a dynamic scale starting far too high: it halves on each overflow until the gradients fit
    result = Trainer(tiny_config(corpus, train_iters=8, fp16=True, initial_loss_scale=2.0**22), SINGLE).train()
    assert result.iteration == 8
    last = capsys.readouterr().out.splitlines()[-1]
    assert re.fullmatch(
        r" > ([1-7]) of the 8 iterations of this run skipped their step \(non-finite gradients; "
        r"the fp16 loss scale is \d+ now\)",
        last,
    ), last


def test_a_finished_run_started_again_says_it_is_complete(corpus, tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    config = tiny_config(corpus, train_iters=4, save=save, load=save)
    pretrain(config, SINGLE)
    capsys.readouterr()
    again = pretrain(config, SINGLE)
    out = capsys.readouterr().out
    assert again.iteration == 4 and again.losses == [] and again.checkpoint is None
    assert " > training is already complete at iteration 4 of 4; raise --train-iters to train further" in out
    assert "skipped their step" not in out and read_latest(save)[0] == 4


def _line_at(out: str, iteration: int) -> dict[str, str]:
    (line,) = [line for line in out.splitlines() if line.startswith(f" iteration {iteration:8d}/")]
    fields = (field.strip().rsplit(": ", 1) for field in line.split("|")[1:-1])
    return {name: value for name, value in fields}


@pytest.mark.parametrize("stop", ["save_interval", "exit_interval"])
def test_the_first_line_after_a_resume_averages_the_same_iterations(corpus, tmp_path, capsys, stop):
    """Saved at iteration 7 (a --save-interval, or a planned exit), between the log lines at 5 and
    10: the resumed run's line at 10 is the uninterrupted run's, iterations 6 to 10."""
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    full = Trainer(tiny_config(corpus, train_iters=10, log_interval=5, save=str(full_dir), **{stop: 7}), SINGLE)
    full_result = full.train()
    if stop == "exit_interval":  # the uninterrupted run is the one without the exit
        full_result = Trainer(tiny_config(corpus, train_iters=10, log_interval=5), SINGLE).train()
    full_out = capsys.readouterr().out
    resumed_dir.mkdir()
    shutil.copytree(full_dir / iteration_tag(7), resumed_dir / iteration_tag(7))
    (resumed_dir / LATEST_FILE).write_text("7\n")
    manifest = json.loads((resumed_dir / iteration_tag(7) / MANIFEST_FILE).read_text())
    assert len(manifest["run"]["log_window"]["losses"][0]) == 2  # iterations 6 and 7
    resumed = Trainer(tiny_config(corpus, train_iters=10, log_interval=5, load=str(resumed_dir)), SINGLE).train()
    resumed_out = capsys.readouterr().out
    expected, got = _line_at(full_out.split("exiting at")[-1], 10), _line_at(resumed_out, 10)
    for name in ("lm loss", "grad norm", "learning rate", "number of skipped iterations", "consumed samples"):
        assert got[name] == expected[name], name
    assert resumed.losses == full_result.losses[7:]  # the result holds only the iterations this run trained
