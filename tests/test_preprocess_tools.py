"""tools/preprocess_data.py and tools/train_tokenizer.py end to end on small corpora."""

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron.cli import preprocess_data, train_tokenizer
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.preprocess import preprocess
from megatron.data.tokenizer import build_tokenizer
from megatron.errors import DataError
from megatron.tokenizer_spec import TokenizerSpec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = [
    {"text": "1 2 3", "title": "7"},
    {"text": "", "title": "8 9"},
    {"text": "4 5", "title": ""},
    {"text": "6", "title": "10 11 12"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_jsonl_with_two_workers(tmp_path):
    rows = ROWS * 50
    source = write_jsonl(tmp_path / "corpus.jsonl", rows)
    preprocess_data.main(
        [
            "--input",
            source,
            "--json-keys",
            "text",
            "title",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "20",
            "--append-eod",
            "--output-prefix",
            str(tmp_path / "out" / "c"),
            "--workers",
            "2",
            "--log-interval",
            "10",
        ]
    )
    for key in ("text", "title"):
        dataset = MMapIndexedDataset(str(tmp_path / "out" / f"c_{key}_document"))
        expected = [[int(t) for t in row[key].split()] + [19] for row in rows if row[key]]
        assert dataset.dtype == np.uint16
        assert [dataset[i].tolist() for i in range(len(dataset))] == expected
        # An empty row is an empty document: a doc_idx entry and no sequence, as Megatron-LM writes it.
        assert dataset.doc_idx.tolist() == [0, *np.cumsum([bool(row[key]) for row in rows]).tolist()]
    assert sorted(os.listdir(tmp_path / "out")) == sorted(
        f"c_{k}_document.{e}" for k in ("text", "title") for e in ("bin", "idx", "checksum.json")
    )


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["text", "title"])
        writer.writeheader()
        writer.writerows(rows)


def write_parquet(path, rows):
    import pyarrow
    import pyarrow.parquet

    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)


@pytest.mark.parametrize("suffix, write", [(".csv", write_csv), (".parquet", write_parquet)])
def test_table_inputs_through_a_glob(tmp_path, suffix, write):
    write(tmp_path / f"part1{suffix}", ROWS[:2])
    write(tmp_path / f"part2{suffix}", ROWS[2:])
    spec = TokenizerSpec("NullTokenizer", vocab_size=20)
    [prefix] = preprocess(str(tmp_path / f"part*{suffix}"), str(tmp_path / "c"), spec, ["text"])
    dataset = MMapIndexedDataset(prefix)
    assert [dataset[i].tolist() for i in range(len(dataset))] == [[1, 2, 3], [4, 5], [6]]


def test_sentencepiece_corpus(tmp_path):
    lines = [f"expert {i} routes token {i * 3} to layer {i % 4}" for i in range(200)]
    source = write_jsonl(tmp_path / "corpus.jsonl", [{"body": line} for line in lines])
    train_tokenizer.main(
        [
            "--input",
            source,
            "--json-keys",
            "body",
            "--vocab-size",
            "100",
            "--model-type",
            "unigram",
            "--model-prefix",
            str(tmp_path / "sp"),
        ]
    )
    spec = TokenizerSpec("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "sp.model"))
    [prefix] = preprocess(source, str(tmp_path / "c"), spec, ["body"], append_eod=True, workers=2)
    tokenizer, dataset = build_tokenizer(**vars(spec)), MMapIndexedDataset(prefix)
    assert len(dataset) == len(lines)
    assert dataset[5][-1] == tokenizer.eod
    assert tokenizer.detokenize(dataset[5][:-1]) == lines[5]


def test_empty_corpus_writes_nothing(tmp_path):
    source = write_jsonl(tmp_path / "corpus.jsonl", [{"text": ""}, {"text": ""}])
    spec = TokenizerSpec("NullTokenizer", vocab_size=20)
    with pytest.raises(DataError, match=r"corpus\.jsonl has no non-empty text under key 'text'"):
        preprocess(source, str(tmp_path / "out"), spec, ["text"], workers=2)
    assert os.listdir(tmp_path) == ["corpus.jsonl"]


def test_input_errors(tmp_path):
    spec = TokenizerSpec("NullTokenizer", vocab_size=20)
    with pytest.raises(DataError, match=r"--input .*nothing\*\.jsonl matches no file"):
        preprocess(str(tmp_path / "nothing*.jsonl"), str(tmp_path / "c"), spec, ["text"])
    source = write_jsonl(tmp_path / "corpus.jsonl", ROWS)
    with pytest.raises(DataError, match="no column 'body' .*columns: text, title"):
        preprocess(source, str(tmp_path / "c"), spec, ["body"])
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(DataError, match=r"\['\.txt'\]"):
        preprocess(str(tmp_path / "notes.txt"), str(tmp_path / "c"), spec, ["text"])


def test_main_prints_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        preprocess_data.main(
            [
                "--input",
                str(tmp_path / "none.jsonl"),
                "--tokenizer-type",
                "NullTokenizer",
                "--output-prefix",
                str(tmp_path / "c"),
            ]
        )
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == "error: --tokenizer-type NullTokenizer needs --vocab-size; pass it.\n"
    with pytest.raises(SystemExit):
        train_tokenizer.main(
            ["--input", str(tmp_path / "none.txt"), "--vocab-size", "10", "--model-prefix", str(tmp_path / "m")]
        )
    assert capsys.readouterr().err.startswith("error: --input")


@pytest.mark.parametrize("script", ["tools/preprocess_data.py", "tools/train_tokenizer.py"])
def test_wrappers_run_from_anywhere(tmp_path, script):
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, script), "--help"], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 0 and "--input" in result.stdout
