"""The Hugging Face import's faults (issue 29), each injected into a tiny GPT-2 folder as
save_pretrained writes it, each refused with one sentence by tools/checkpoint/convert.py's entry
point, nothing left at --save: a config.json of another hidden size, an index file that is not
JSON, a disk too small (import and export, their non-weight files counted), a disk that fills up
during the write, a NaN or an infinity in a weight, and a kill part-way, which the rerun recovers
from."""

import errno
import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from safetensors.torch import load_file, save_file

import megatron.hf.our_checkpoint
from megatron.checkpoint.layout import LATEST_FILE
from megatron.checkpoint.verify import verify_folder
from megatron.cli.convert_checkpoint import main
from megatron.data.tokenizer import _bytes_to_unicode
from megatron.parallel import single_process_grid

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face import tests need transformers (pip install transformers)"
)

REPO = Path(__file__).resolve().parents[1]
MERGES = ["t h", "Ġ th", "Ġth e", "Ã ©", "c a", "ca f", "caf Ã©"]
GPT2 = dict(vocab_size=272, n_embd=32, n_layer=2, n_head=4, n_positions=32, n_inner=40, activation_function="gelu")
LLAMA = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    intermediate_size=40,
    max_position_embeddings=32,
)


class Usage(NamedTuple):
    total: int
    used: int
    free: int


def save_model(config: "transformers.PretrainedConfig", folder: Path) -> Path:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A random GPT-2 with its GPT-2 BPE tokenizer files (264 ids in 272 rows)."""
    folder = save_model(transformers.GPT2Config(**GPT2), tmp_path_factory.mktemp("pristine") / "hf")
    pieces = list(_bytes_to_unicode().values()) + [merge.replace(" ", "") for merge in MERGES] + ["<|endoftext|>"]
    (folder / "vocab.json").write_text(json.dumps({piece: i for i, piece in enumerate(pieces)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(MERGES) + "\n")
    return folder


@pytest.fixture
def source(pristine, tmp_path) -> Path:
    """A copy of the pristine folder, to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "hf"))


def refusal(argv: list[str], capsys) -> str:
    """The one line the entry point prints for `argv`, which must stop with exit status 1."""
    capsys.readouterr()  # what came before (save_pretrained's progress bars)
    with pytest.raises(SystemExit) as stop:
        main(argv)
    error = capsys.readouterr().err
    assert stop.value.code == 1 and error.startswith("error: ") and error.count("\n") == 1, error
    return error.removeprefix("error: ").strip()


def import_refusal(source: Path, save: Path, capsys) -> str:
    message = refusal(["--from", "hf", "--load", str(source), "--save", str(save)], capsys)
    assert not save.exists() and not save.with_name(save.name + ".tmp").exists()
    return message


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def report_free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(total=free, used=0, free=free))


@pytest.mark.parametrize(
    "config, key, value, message",
    [
        (
            transformers.GPT2Config(**GPT2),
            "n_embd",
            36,
            r"transformer\.wte\.weight in \S+model\.safetensors has shape \(272, 32\) but \S+config\.json's n_embd "
            r"of 36 calls for \(272, 36\); give the config\.json that was saved with these weights",
        ),
        (
            transformers.LlamaConfig(**LLAMA),
            "num_key_value_heads",
            4,
            r"model\.layers\.0\.self_attn\.k_proj\.weight in \S+ has shape \(24, 32\) but \S+config\.json's "
            r"num_attention_heads x head_dim or num_key_value_heads x head_dim of 48 calls for \(48, 32\)",
        ),
    ],
)
def test_a_config_json_of_other_sizes_than_the_weights_is_refused_naming_tensor_shapes_and_key(
    config, key, value, message, tmp_path, capsys
):
    folder = save_model(config, tmp_path / "hf")
    content = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**content, key: value}))
    assert re.fullmatch(message + ".*", import_refusal(folder, tmp_path / "ckpt", capsys))


@pytest.mark.parametrize(
    "text, problem",
    [('{"weight_map": {"transformer.wte.weight": ', "is not JSON"), ('{"metadata": {}}', "has no weight_map")],
)
def test_an_index_file_that_is_not_json_or_lacks_its_map_is_one_sentence_naming_it(
    text, problem, source, tmp_path, capsys
):
    (source / "model.safetensors.index.json").write_text(text)
    message = import_refusal(source, tmp_path / "ckpt", capsys)
    assert message.startswith(f"{source / 'model.safetensors.index.json'} {problem}")
    assert message.endswith("replace it with the one save_pretrained wrote beside the shards")


def test_a_disk_too_small_for_the_import_or_the_export_is_refused_before_anything_is_written(
    source, tmp_path, capsys, monkeypatch
):
    main(["--from", "hf", "--load", str(source), "--save", str(tmp_path / "imported")])
    main(["--to", "hf", "--load", str(tmp_path / "imported"), "--save", str(tmp_path / "exported")])
    capsys.readouterr()
    written = {"import": folder_bytes(tmp_path / "imported"), "export": folder_bytes(tmp_path / "exported")}
    weights = (tmp_path / "exported" / "model.safetensors").stat().st_size
    assert weights < written["export"] - 1  # the weights alone fit: the tokenizer and config.json must be counted
    report_free(monkeypatch, written["import"] - 1)
    message = import_refusal(source, tmp_path / "ckpt", capsys)
    assert message.startswith("the import needs about ") and message.endswith(
        "free; free space or give --save on a larger disk"
    )
    assert int(message.split()[4].replace(",", "")) >= written["import"]
    report_free(monkeypatch, written["export"] - 1)
    message = refusal(["--to", "hf", "--load", str(tmp_path / "imported"), "--save", str(tmp_path / "hf2")], capsys)
    assert (
        message.startswith("the export needs about ") and int(message.split()[4].replace(",", "")) >= written["export"]
    )
    assert not (tmp_path / "hf2").exists() and not (tmp_path / "hf2.tmp").exists()


def test_a_disk_that_fills_up_during_the_import_is_one_sentence_and_leaves_nothing(
    source, tmp_path, capsys, monkeypatch
):
    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(megatron.hf.our_checkpoint, "write_tensor_file", full_disk)
    message = import_refusal(source, tmp_path / "ckpt", capsys)
    assert message.startswith(f"the disk of --save {tmp_path / 'ckpt'} filled up during the import (No space left")
    assert "so nothing was left there; free space (it needs about " in message


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_nan_or_an_infinity_in_a_weight_is_refused_naming_the_tensor(value, source, tmp_path, capsys):
    weights = load_file(source / "model.safetensors")
    weights["transformer.h.1.mlp.c_proj.weight"][3, 5] = value
    save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
    assert import_refusal(source, tmp_path / "ckpt", capsys) == (
        f"transformer.h.1.mlp.c_proj.weight in {source / 'model.safetensors'} holds a NaN or an infinity, so "
        f"{source} was not imported; replace the file with an intact copy, or repair the model and save it again"
    )


KILLED_AFTER_FIRST_WEIGHTS_FILE = """
import os, signal, sys
sys.path.insert(0, {repo!r})
import megatron.hf.our_checkpoint as our_checkpoint
from megatron.cli.convert_checkpoint import main

write_tensor_file = our_checkpoint.write_tensor_file


def write_then_die(*args, **kwargs):
    write_tensor_file(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)


our_checkpoint.write_tensor_file = write_then_die
main(sys.argv[1:])
"""


def test_a_kill_during_the_import_leaves_no_save_folder_and_the_rerun_succeeds(source, tmp_path, capsys):
    script = tmp_path / "killed_import.py"
    script.write_text(KILLED_AFTER_FIRST_WEIGHTS_FILE.format(repo=str(REPO)))
    save, argv = tmp_path / "ckpt", ["--from", "hf", "--load", str(source), "--save", str(tmp_path / "ckpt")]
    killed = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    staging = save.with_name("ckpt.tmp")
    assert not save.exists() and (staging / "iter_0000000" / "model_rank00000.safetensors").is_file()
    assert (staging / "tokenizer" / "vocab.json").is_file()  # the tokenizer went through the same folder
    main(argv)
    assert f"removed {staging}, left by a conversion that was interrupted" in capsys.readouterr().out
    assert not staging.exists() and (save / LATEST_FILE).read_text() == "0\n"
    assert verify_folder(save / "iter_0000000", single_process_grid(torch.device("cpu"))) is not None
    assert sorted(path.name for path in save.iterdir()) == ["iter_0000000", LATEST_FILE, "tokenizer"]
