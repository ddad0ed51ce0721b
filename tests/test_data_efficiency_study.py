"""tools/data_efficiency_study.py: its numbers come from the trainer's own log lines (iterations,
samples, tokens, the last validation loss, the iterations' time without start-up or evaluation),
and it stops with one sentence without the demo corpus."""

import subprocess
import sys

import pytest

from megatron.training.log import IntervalStats, TrainingLogger
from tools.data_efficiency_study import REPO, Run, summarise


def trainer_log(capsys: pytest.CaptureFixture[str]) -> str:
    """Three log lines and a validation line as the trainer's logger prints them."""
    log = TrainingLogger(None, enabled=True)
    for iteration, samples, tokens, ms in [(10, 160, 20480, 300.0), (20, 320, 51200, 400.0), (25, 400, 71680, 500.0)]:
        stats = IntervalStats(samples, tokens, ms, 1e-3, 16, 6.5, 0.01, None, None, 1.0, 0, 0, 1e4, 0.1, 0.01)
        log.training_line(iteration, 25, stats)
    log.evaluation_line("validation", 25, 6.125)
    return capsys.readouterr().out


def test_a_run_is_summarised_from_its_log_lines(capsys):
    run = summarise(Run("x", {}), trainer_log(capsys), 12.5)
    assert (run.iterations, run.consumed_samples, run.consumed_tokens) == (25, 400, 71680)
    assert run.validation_loss == 6.125 and run.process_seconds == 12.5
    assert run.train_seconds == pytest.approx(10 * 0.3 + 10 * 0.4 + 5 * 0.5)


def test_a_log_without_its_lines_stops_the_study_by_name():
    with pytest.raises(SystemExit, match="seqlen: no log lines or validation loss"):
        summarise(Run("seqlen", {}), " > nothing here\n", 1.0)


def test_without_the_demo_corpus_it_names_the_command_that_builds_it(tmp_path):
    done = subprocess.run([sys.executable, "tools/data_efficiency_study.py", "--demo-dir", str(tmp_path),
                           "--work-dir", str(tmp_path / "work")], capture_output=True, text=True, cwd=REPO)  # fmt: skip
    assert done.returncode == 1 and "run `make demo` first" in done.stderr
