"""Bad rows in the corpus given to tools/preprocess_data.py (issue 14).

A value that cannot be text (bad JSON, a number, a list, invalid UTF-8) stops the real command
with exit status 1 and one line on stderr naming the file and line; null or missing text, and with
--skip-invalid-utf8 invalid UTF-8, drop the row and are counted in one summary line at the end.
"""

import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time

import pyarrow
import pyarrow.parquet
import pytest

from megatron.cli import preprocess_data
from megatron.data import preprocess
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.entry_point import run_entry_point
from megatron.errors import DataError
from megatron.tokenizer_spec import TokenizerSpec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_UTF8 = "that is not valid UTF-8; fix the file's encoding or pass --skip-invalid-utf8 to skip such rows."
NOT_TEXT = "where text was expected; fix that row or pick text columns with --json-keys."


def jsonl(*rows) -> bytes:
    """One line per row: a dict becomes JSON, bytes are written as they are (a damaged line)."""
    return b"".join((row if isinstance(row, bytes) else json.dumps(row).encode()) + b"\n" for row in rows)


def parquet(texts: list[bytes | None], column_name: str = "text") -> bytes:
    """A Parquet file whose one string column holds these bytes unchecked, as some writers allow."""
    as_binary = pyarrow.array(texts, type=pyarrow.binary())
    column = pyarrow.Array.from_buffers(pyarrow.string(), len(as_binary), as_binary.buffers())
    sink = pyarrow.BufferOutputStream()
    pyarrow.parquet.write_table(pyarrow.table({column_name: column}), sink)
    return sink.getvalue().to_pybytes()


def tool_flags(tmp_path, name: str, content: bytes, *flags: str) -> list[str]:
    """Write the corpus; the flags that tokenize it into tmp_path/out/c_*."""
    (tmp_path / name).write_bytes(content)
    return [
        "--input",
        str(tmp_path / name),
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "20",
        "--output-prefix",
        str(tmp_path / "out/c"),
        *flags,
    ]


def run_tool(tmp_path, name: str, content: bytes) -> subprocess.CompletedProcess:
    # A pool of two: the error has to cross from the reader through it, and the pool must stop at once.
    command = [sys.executable, os.path.join(REPO, "tools/preprocess_data.py"), "--workers", "2"]
    command += tool_flags(tmp_path, name, content)
    return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "name, content, where, problem",
    [
        pytest.param(
            "c.jsonl", jsonl({"text": "1"}, {"text": 5}), "line 2", f"has a number under 'text' {NOT_TEXT}", id="number"
        ),
        pytest.param(
            "c.jsonl",
            jsonl({"text": "1"}, {"text": "2"}, {"text": [1, 2]}),
            "line 3",
            f"has a list under 'text' {NOT_TEXT}",
            id="list",
        ),
        pytest.param(
            "c.jsonl",
            jsonl({"text": "1"}, b'{"text": "2"', {"text": "3"}),
            "line 2",
            "is not valid JSON (Expecting ',' delimiter at column 13); fix or drop the line.",
            id="bad JSON line",
        ),
        pytest.param(
            "c.jsonl",
            jsonl({"text": "1"}, b"", b'["2"]'),
            "line 3",
            "is a list, not a JSON object; make every row an object holding the text.",
            id="not an object",
        ),
        pytest.param(
            "c.jsonl",
            jsonl({"text": "1"}, {"text": "2"}, b'{"text": "3 \xff"}'),
            "line 3",
            f"has text under 'text' {NOT_UTF8}",
            id="invalid UTF-8",
        ),
        pytest.param(
            "c.jsonl",
            jsonl({"text": "1"}, b'{"text": "2 \\ud800"}'),
            "line 2",
            f"has text under 'text' {NOT_UTF8}",
            id="lone surrogate escape",
        ),
        pytest.param(
            "c.csv",
            b'title,text\nx,1\r\ny,"2\n3 \xe9"\r\nz,4\r\n',
            "line 3",
            f"has text under 'text' {NOT_UTF8}",
            id="invalid UTF-8 in CSV",
        ),
        pytest.param(
            "c.json",
            b'[\n  {"text": "1"},\n  {"text": 2 3}\n]\n',
            "line 3",
            "is not valid JSON (Expecting ',' delimiter at column 14); fix the file.",
            id="bad JSON list",
        ),
        pytest.param(
            "c.json",
            b'[{"text": "1"}, {"text": "2 \xc3("}]',
            "row 2",
            f"has text under 'text' {NOT_UTF8}",
            id="invalid UTF-8 in JSON list",
        ),
        pytest.param(
            "c.parquet",
            parquet([b"1", None, b"3 \xff"]),
            "row 3",
            f"has text under 'text' {NOT_UTF8}",
            id="invalid UTF-8 in Parquet",
        ),
    ],
)
def test_bad_row_stops_the_tool_with_one_line_naming_file_and_line(tmp_path, name, content, where, problem):
    result = run_tool(tmp_path, name, content)
    assert result.returncode == 1, result.stderr
    assert result.stderr == f"error: {tmp_path / name} {where} {problem}\n"
    assert sorted(os.listdir(tmp_path)) == [name, "out"] and os.listdir(tmp_path / "out") == []


def read(prefix: str) -> list[list[int]]:
    dataset = MMapIndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


@pytest.mark.parametrize(
    "name, content, summary, documents",
    [
        pytest.param(
            "c.jsonl",
            jsonl({"text": "1"}, {"text": None}, {"text": "3"}),
            ["skipped 1 row whose 'text' was null or missing"],
            [[1], [3]],
            id="null",
        ),
        pytest.param(
            "c.jsonl",
            jsonl({"text": "1"}, {"title": "2"}, {"text": None}, {"text": "4"}),
            ["skipped 2 rows whose 'text' was null or missing"],
            [[1], [4]],
            id="missing and null",
        ),
        pytest.param(
            "c.jsonl", jsonl({"text": "1"}, {"text": ""}, {"text": "3"}), [], [[1], [3]], id="empty text is not counted"
        ),
        pytest.param(
            "c.csv",
            b"title,text\nx,1\ny\nz,3\n",
            ["skipped 1 row whose 'text' was null or missing"],
            [[1], [3]],
            id="short CSV row",
        ),
        pytest.param(
            "c.json",
            b' \n[{"text": "1"}, {"text": null}, {}]',
            ["skipped 2 rows whose 'text' was null or missing"],
            [[1]],
            id="JSON list",
        ),
        pytest.param(
            "c.json",
            jsonl({"text": None}, {"text": "2"}),
            ["skipped 1 row whose 'text' was null or missing"],
            [[2]],
            id="JSON lines in .json",
        ),
        pytest.param(
            "c.parquet",
            parquet([b"1", None, b"3"]),
            ["skipped 1 row whose 'text' was null or missing"],
            [[1], [3]],
            id="Parquet null",
        ),
    ],
)
def test_null_or_missing_text_is_counted_once_at_the_end(tmp_path, capsys, name, content, summary, documents):
    (tmp_path / name).write_bytes(content)
    spec = TokenizerSpec("NullTokenizer", vocab_size=20)
    [prefix] = preprocess.preprocess(str(tmp_path / name), str(tmp_path / "c"), spec, ["text"])
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("skipped")] == summary
    assert read(prefix) == documents


def test_each_key_gets_its_own_summary_line(tmp_path, capsys):
    content = jsonl({"text": "1", "title": "2"}, {"text": None, "title": "3"}, {"title": None}, {"text": "4"})
    preprocess_data.main(tool_flags(tmp_path, "c.jsonl", content, "--json-keys", "text", "title"))
    assert capsys.readouterr().out.splitlines()[-4:] == [
        "skipped 2 rows whose 'text' was null or missing",
        "skipped 2 rows whose 'title' was null or missing",
        f"wrote {tmp_path}/out/c_text_document.bin and {tmp_path}/out/c_text_document.idx",
        f"wrote {tmp_path}/out/c_title_document.bin and {tmp_path}/out/c_title_document.idx",
    ]
    assert read(str(tmp_path / "out/c_text_document")) == [[1], [4]]
    assert read(str(tmp_path / "out/c_title_document")) == [[2], [3]]


SKIPPED_ONE = ["skipped 1 row with text that is not valid UTF-8"]


@pytest.mark.parametrize(
    "name, content, summary, documents",
    [
        pytest.param(
            "c.jsonl",
            jsonl({"text": "1"}, b'{"text": "2 \xff"}', {"text": "3"}, b'{"text": "\xc3("}'),
            ["skipped 2 rows with text that is not valid UTF-8"],
            [[1], [3]],
            id="JSONL",
        ),
        pytest.param(
            "c.jsonl", jsonl({"text": "1"}, b'{"text": "2 \\udc80"}'), SKIPPED_ONE, [[1]], id="lone surrogate escape"
        ),
        pytest.param("c.csv", b"text\n1\n2 \xff\n3\n", SKIPPED_ONE, [[1], [3]], id="CSV"),
        pytest.param("c.parquet", parquet([b"\xff", b"2", b"3"]), SKIPPED_ONE, [[2], [3]], id="Parquet"),
        pytest.param("c.jsonl", jsonl(b'{"text": "1", "note": "\xff"}'), [], [[1]], id="other fields are not checked"),
    ],
)
def test_skip_invalid_utf8_drops_and_counts_the_rows(tmp_path, capsys, name, content, summary, documents):
    preprocess_data.main(tool_flags(tmp_path, name, content, "--skip-invalid-utf8"))
    output = capsys.readouterr()
    assert [line for line in output.out.splitlines() if line.startswith("skipped")] == summary
    assert output.err == ""
    assert read(str(tmp_path / "out/c_text_document")) == documents


@pytest.mark.parametrize(
    "name, content, message",
    [
        pytest.param(
            "c.jsonl",
            jsonl({"body": "1"}, {"body": None}),
            r"has no column 'text' with text in any row "
            r"\(its first row has columns: body\); fix --json-keys\.",
            id="key in no row",
        ),
        pytest.param(
            "c.parquet",
            parquet([b"1"], "body"),
            r"has no column 'text' with text in any "
            r"row \(its first row has columns: body\); fix --json-keys\.",
            id="key in no Parquet column",
        ),
        pytest.param(
            "c.jsonl",
            jsonl({"text": None}, {"text": None}),
            r"has no column 'text' with text in any row "
            r"\(its first row has columns: text\); fix --json-keys\.",
            id="all null",
        ),
        pytest.param(
            "c.jsonl",
            jsonl(b'{"text": "\xff"}'),
            r"has no row whose text is valid UTF-8 \(all 1 skipped\); "
            r"fix the file's encoding\.",
            id="every row skipped",
        ),
        pytest.param("c.jsonl", b"\n\n", r"has no rows; pass a non-empty corpus\.", id="no rows"),
    ],
)
def test_corpus_left_without_text_writes_nothing(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    spec = TokenizerSpec("NullTokenizer", vocab_size=20)
    with pytest.raises(DataError, match=rf"^--input {re.escape(str(tmp_path / name))} {message}$"):
        preprocess.preprocess(str(tmp_path / name), str(tmp_path / "c"), spec, ["text"], skip_invalid_utf8=True)
    assert os.listdir(tmp_path) == [name]


def test_byte_order_mark_and_crlf_line_ends_are_read(tmp_path):
    (tmp_path / "c.csv").write_bytes(b"\xef\xbb\xbftext\r\n1 2\r\n3\r\n")
    (tmp_path / "c.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "1 2"}\r\n{"text": "3"}\r\n')
    spec = TokenizerSpec("NullTokenizer", vocab_size=20)
    for name in ("c.csv", "c.jsonl"):
        [prefix] = preprocess.preprocess(str(tmp_path / name), str(tmp_path / name), spec, ["text"])
        assert read(prefix) == [[1, 2], [3]]


def test_forked_workers_die_at_once_on_sigterm_under_the_graceful_handler():
    """A bad row ends the pool with Pool.terminate(), a SIGTERM to each worker. Had the workers kept
    run_entry_point's graceful handler (forked along) as it is, one signalled while still starting
    would swallow the SystemExit and wait for ever, and the tool with it: they die by the signal."""
    previous = signal.getsignal(signal.SIGTERM)
    fork = multiprocessing.get_context("fork")
    try:

        def start_and_signal() -> int | None:
            worker = fork.Process(target=time.sleep, args=(60,))
            worker.start()
            os.kill(worker.pid, signal.SIGTERM)
            worker.join(timeout=30)
            return worker.exitcode

        assert run_entry_point(start_and_signal) == -signal.SIGTERM  # killed by the signal, not SystemExit(143)
        with run_entry_point(lambda: fork.Pool(2)) as pool:
            assert pool.apply(os.getpid) != os.getpid()
        assert callable(signal.getsignal(signal.SIGTERM))  # the tool itself keeps the graceful handler
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize(
    "name, content, message",
    [
        pytest.param(
            "c.txt",
            b"one line\ntwo \xff\n",
            r"c.txt line 2 is not valid UTF-8; fix the file's encoding\.",
            id="plain text, invalid UTF-8",
        ),
        pytest.param(
            "c.jsonl", jsonl({"text": "1"}, b'{"text": "2"'), r"c.jsonl line 2 is not valid JSON", id="bad JSON line"
        ),
        pytest.param(
            "c.jsonl",
            jsonl({"text": "1"}, {"text": 7}),
            rf"c.jsonl line 2 has a number under 'text' {NOT_TEXT}",
            id="number",
        ),
        pytest.param(
            "c.jsonl",
            jsonl({"text": "ok"}, b'{"text": "\xfe"}'),
            r"c.jsonl line 2 has text under 'text' that is "
            r"not valid UTF-8",
            id="JSON lines, invalid UTF-8",
        ),
    ],
)
def test_tokenizer_training_reads_the_corpus_as_preprocessing_does(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    command = [
        sys.executable,
        os.path.join(REPO, "tools/train_tokenizer.py"),
        "--input",
        str(tmp_path / name),
        "--vocab-size",
        "40",
        "--model-prefix",
        str(tmp_path / "tok"),
    ]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:") or "Traceback" in line]
    assert len(errors) == 1 and re.search(message, errors[0]), done.stderr
