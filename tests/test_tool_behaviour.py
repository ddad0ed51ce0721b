"""Every command-line tool ends the way a shell expects: on success exit 0 with only its summary on
stdout (and at most a progress bar on stderr, never a dumped result dict); on bad input exit 1 with
one sentence on stderr, no traceback. Each runs as a user runs it, in a fresh process: the
installed console script, or the script under tools/."""

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.inference_fixtures import train_checkpoint
from tests.training_fixtures import write_corpus

REPO = Path(__file__).resolve().parent.parent
SWEEP = {
    "block_size": ["256K", "1M"],
    "queue_depth": [4],
    "intra_op_parallelism": [1],
    "single_submit": [False],
    "overlap_events": [False],
}
MODEL = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16"
RUN = f"{MODEL} --micro-batch-size 2 --global-batch-size 4 --train-iters 10 --lr 1e-3 --tokenizer-type NullTokenizer"
SIZED = r"[\d,]+ \([\d.]+[KMB]\)"  # 1,234,567 (1.23M)

# (tool, arguments, stdout pattern searched for, the progress bar's label on stderr or "" for an
# empty stderr); {tmp}, {sweep}, {checkpoint} and {corpus} are filled in per test
SUCCESSES = [
    (
        "ds_io",
        "--write --folder {tmp} --io_size 4M --block_size 256K --queue_depth 8 --loops 1 --warmup 0",
        r"\Awrite io_size=4M block_size=256K queue_depth=8 .*: [\d.]+ GB/s \(median; loops [\d.]+\)\n\Z",
        "",
    ),
    (
        "ds_nvme_tune",
        "--nvme_dir {tmp} --sweep_config {sweep} --io_size 2M --loops 1",
        r'\Abest write: .*\nbest read : .*\nPaste into the config .*\n"aio": \{\n(  .*\n){5}\}\n\Z',
        "ds_nvme_tune: ",
    ),
    (
        "tools/model_size.py",
        MODEL,
        rf"\Anote: .* GPT-2's vocabulary of 50,257 tokens \(padded to 50,304\)\nmodel: .*\n"
        rf"total parameters: {SIZED}\nactive parameters per token: {SIZED}\ntraining FLOPs per token: {SIZED}, ",
        "",
    ),
    (
        "tools/evaluate_ppl.py",
        "--load {checkpoint} --data-path {corpus} --max-tokens 40 --batch-size 1",
        r"\A\S+ \| tokens: 39 \| lm loss: [\d.]+ \| perplexity: [\d.]+\n\Z",
        "perplexity: ",
    ),
    (
        "tools/analyze_data.py",
        f"{RUN} --vocab-size 61 --data-path {{corpus}} --save {{tmp}}/analysis",
        r"\A > vocab_rarity of \d+ training samples: min \d+, max \d+, mean [\d.]+; index in \S+/vocab_rarity\n\Z",
        "analysis: ",
    ),
]

# (tool, arguments, what the one sentence on stderr names)
FAILURES = [
    ("ds_io", "--write --folder {tmp}/missing", r"--folder \S+/missing does not exist"),
    ("ds_io", "--write --folder {tmp} --loops 0", r"--loops: '0' is not a positive integer"),
    ("ds_io", "--write --folder {tmp} --io-size 4M", r"--io-size\b.*--io_size"),  # names the flag meant
    ("ds_nvme_tune", "--nvme_dir {tmp}/missing", r"--nvme_dir \S+/missing does not exist"),
    ("ds_nvme_tune", "--nvme_dir {tmp} --no_read --no_write", r"leave nothing to tune"),
    (
        "ds_nvme_tune",
        "--nvme_dir {tmp} --log_dir {sweep}/logs",
        r"--log_dir \S+/logs cannot be made \(Not a directory\)",
    ),
    ("tools/model_size.py", "--num-layers 2 --hidden-size 64", r"--num-attention-heads"),
    ("tools/model_size.py", f"{MODEL} --world-size 0", r"--world-size: '0' is not a positive integer"),
    ("tools/model_size.py", f"{MODEL} --vocab-size 100 --padded-vocab-size 128", r"both given"),
    ("tools/evaluate_ppl.py", "--load {tmp}/missing --jsonl {tmp}/text.jsonl", r"\S+/missing/\S+ is missing"),
    ("tools/evaluate_ppl.py", "--load {tmp} --jsonl {tmp}/text.jsonl --batch-size 0", r"--batch-size"),
    ("tools/analyze_data.py", f"{RUN} --vocab-size 61 --data-path {{corpus}}", r"writes its index under --save"),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny trained MoE checkpoint and its corpus, for the perplexity tool."""
    folder = tmp_path_factory.mktemp("checkpoint")
    corpus, save = write_corpus(folder), str(folder / "ckpt")
    train_checkpoint(corpus, save)
    return {"checkpoint": save, "corpus": corpus}


def _run(tool: str, arguments: str, tmp_path: Path, request: pytest.FixtureRequest) -> subprocess.CompletedProcess:
    if tool.endswith(".py"):
        command = [sys.executable, str(REPO / tool)]
    else:
        script = Path(sysconfig.get_path("scripts")) / tool
        assert script.exists(), f"the {tool} console script is not installed: run `pip install -e .` (make install)"
        command = [str(script)]
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps(SWEEP))
    paths = {"tmp": str(tmp_path), "sweep": str(sweep)}
    if "{checkpoint}" in arguments:
        paths |= request.getfixturevalue("checkpoint")
    elif "{corpus}" in arguments:
        paths["corpus"] = write_corpus(tmp_path)
    # PYTHONPATH: this checkout's code, wherever the editable install points
    return subprocess.run(
        command + arguments.format(**paths).split(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


@pytest.mark.parametrize("tool, arguments, stdout, bar", SUCCESSES, ids=[case[0] for case in SUCCESSES])
def test_success_exits_0_with_the_summary_only(
    tool: str, arguments: str, stdout: str, bar: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    done = _run(tool, arguments, tmp_path, request)
    assert done.returncode == 0, done.stderr
    assert re.search(stdout, done.stdout), done.stdout
    redraws = re.split(r"[\r\n]+", done.stderr.strip())  # tqdm redraws its line with \r
    if bar:  # the bar and nothing else, run to its end
        assert all(line.startswith(bar) for line in redraws) and "100%" in redraws[-1], done.stderr
    else:
        assert done.stderr == ""


@pytest.mark.parametrize("tool, arguments, names", FAILURES, ids=[f"{case[0]} {case[1]}" for case in FAILURES])
def test_failure_exits_1_with_one_sentence(
    tool: str, arguments: str, names: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    done = _run(tool, arguments, tmp_path, request)
    assert done.returncode == 1, done.stderr
    assert re.fullmatch(r"error: [^\n]+\n", done.stderr), done.stderr
    assert re.search(names, done.stderr), done.stderr
    assert done.stdout == ""


def test_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """`tool | head` closes the pipe early: no BrokenPipeError traceback, the status a shell expects."""
    process = subprocess.Popen(
        [sys.executable, str(REPO / "tools/model_size.py"), *MODEL.split()],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    process.stdout.close()  # before the tool has written anything: its first write finds no reader
    assert process.wait(timeout=120) == 141
    assert process.stderr.read() == ""
