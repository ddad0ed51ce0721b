"""The commands in README.md and docs/ as a reader would paste them: every flag a shell block passes
to one of our tools is a flag that tool's parser knows, every `--flag` the prose names belongs to
some tool, every script a block runs exists, and the examples that run in seconds here are run
(the async-I/O example as pasted, the 52B sizing with the output the page shows)."""

import argparse
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from megatron.cli import (
    analyze_data,
    autotune,
    convert_checkpoint,
    ds_io,
    ds_nvme_tune,
    evaluate_ppl,
    generate,
    lr_range_test,
    model_size,
    preprocess_data,
    train_tokenizer,
)
from megatron.config.flags import build_parser as pretrain_parser
from tasks.eval_harness import evaluate
from tools import balancing_study, data_efficiency_study, quality_study

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", REPO / "examples_deepspeed/MoE/README.md", *sorted((REPO / "docs").glob("*.md"))]
PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "pretrain_gpt.py": pretrain_parser,
    "tools/train_tokenizer.py": train_tokenizer.build_parser,
    "tools/preprocess_data.py": preprocess_data.build_parser,
    "tools/generate.py": generate.build_parser,
    "tools/evaluate_ppl.py": evaluate_ppl.build_parser,
    "tools/checkpoint/convert.py": convert_checkpoint.build_parser,
    "tools/model_size.py": model_size.build_size_parser,
    "tools/autotune.py": autotune.build_autotune_parser,
    "tools/quality_study.py": quality_study.build_parser,
    "tools/balancing_study.py": balancing_study.build_parser,
    "tools/data_efficiency_study.py": data_efficiency_study.build_parser,
    "tasks/eval_harness/evaluate.py": evaluate.build_parser,
    "ds_io": ds_io.build_parser,
    "ds_nvme_tune": ds_nvme_tune.build_parser,
}
# other programs' flags that the pages name: torchrun's, pip's, pytest's, the benchmarks' and fio's
FOREIGN = {
    "--nproc_per_node", "--nproc-per-node", "--nnodes", "--node_rank", "--master_addr", "--master_port",
    "--index-url", "--no-deps", "--durations", "--junitxml", "--ep-size", "--threads", "--direct", "--name",
    "--rw", "--bs", "--iodepth", "--ioengine", "--numjobs", "--size", "--filename", "--async-only", "--step-rows",
}  # fmt: skip
BLOCK = re.compile(r"```(?:bash|sh|shell)\n(.*?)```", re.S)
INLINE_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-zA-Z0-9_-]*)")


def options(parser: argparse.ArgumentParser) -> set[str]:
    return set(parser._option_string_actions)  # argparse's table of every spelling it accepts


def lr_range_test_options() -> set[str]:
    return options(pretrain_parser()) | options(lr_range_test.build_range_test_parser())


def analyze_data_options() -> set[str]:
    return options(pretrain_parser()) | options(analyze_data.build_parser())


def known_options() -> dict[str, set[str]]:
    known = {script: options(build()) for script, build in PARSERS.items()}
    known["tools/lr_range_test.py"] = lr_range_test_options()
    known["tools/analyze_data.py"] = analyze_data_options()
    return known


def commands(page: Path) -> list[list[str]]:
    """Each shell line of the page's fenced blocks, continuations joined, comments dropped, as words."""
    found = []
    for block in BLOCK.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                found.append(words)
    return found


def tool_and_flags(words: list[str], known: dict[str, set[str]]) -> tuple[str, list[str]] | None:
    """The tool a command runs and the flags it passes; a line that starts with `...` continues a
    pretrain_gpt.py command. None for any other program (make, pip, cd, ...)."""
    if words[0] == "...":
        return "pretrain_gpt.py", [w.split("=", 1)[0] for w in words if w.startswith("--")]
    for i in reversed(range(len(words))):  # the last: tools/autotune.py's flags come before the script it runs
        script = next((s for s in known if words[i] == s or words[i].endswith("/" + s)), None)
        if script is not None:
            return script, [w.split("=", 1)[0] for w in words[i + 1 :] if w.startswith("--")]
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_flag_a_shell_block_passes_is_one_its_tool_knows(page: Path) -> None:
    known = known_options()
    unknown, missing = [], []
    for words in commands(page):
        scripts = [w for w in words if w.endswith(".sh") and not w.startswith("-")]
        missing += [w for w in scripts if not (REPO / w).is_file() and not (page.parent / w).is_file()]
        if (found := tool_and_flags(words, known)) is not None:
            script, flags = found
            unknown += [f"{script} {flag}" for flag in flags if flag not in known[script]]
    assert unknown == [] and missing == []


def benchmark_options() -> set[str]:
    """The flags benchmarks/*.py declare (they are scripts, not tools with a parser to import)."""
    declared = re.compile(r"add_argument\(\s*\"(--[^\"]+)\"")
    return {flag for path in (REPO / "benchmarks").glob("*.py") for flag in declared.findall(path.read_text())}


def test_every_flag_the_pages_name_belongs_to_some_tool() -> None:
    every = set().union(*known_options().values()) | benchmark_options() | FOREIGN
    # a typo the pages show on purpose, in the error it gets
    texts = {page.name: re.sub(r"unknown flag --[\w-]+", "", page.read_text()) for page in PAGES}
    named = {(name, flag) for name, text in texts.items() for flag in INLINE_FLAG.findall(text)}
    assert sorted(f"{page}: {flag}" for page, flag in named if flag not in every) == []


def test_the_check_catches_a_renamed_flag(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```bash\npython tools/generate.py --load ckpt \\\n    --max-new-tokenz 8  # typo\n```\n")
    known = known_options()
    assert [tool_and_flags(words, known) for words in commands(page)] == [
        ("tools/generate.py", ["--load", "--max-new-tokenz"])
    ]
    assert "--max-new-tokenz" not in known["tools/generate.py"]


def python_example(page: str, marker: str) -> str:
    text = (REPO / page).read_text()
    return next(block for block in re.findall(r"```python\n(.*?)```", text, re.S) if marker in block)


def test_the_async_io_example_runs_as_pasted(tmp_path: Path) -> None:
    example = python_example("docs/zero-and-offload.md", "AsyncIOBuilder")
    # a fresh interpreter in an empty folder, as a reader pasting it would run it
    done = subprocess.run(
        [sys.executable, "-c", example],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, f"the async-I/O example fails as pasted:\n{done.stderr}"


def test_the_sizing_example_prints_what_the_page_shows() -> None:
    text = (REPO / "docs/distillation.md").read_text()
    command, shown = re.search(r"```bash\n(python tools/model_size\.py.*?)```\n```\n(.*?)```", text, re.S).groups()
    done = subprocess.run(
        [sys.executable, *shlex.split(command.replace("\\\n", " "))[1:]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    printed = done.stdout.splitlines()
    for line in shown.splitlines():
        if line != "...":  # the page elides what lies between
            # the page may shorten a line with (...); the part before it is printed as shown
            assert any(out.startswith(line.split("(...)")[0]) for out in printed), line
