"""Checkpoints saved in format 1 (manifest.json beside engine.json, the raw flags in its client
state) still load after format 2 replaced it: the committed fixture, written by the old code, is
read into the same typed record, resumes to the old code's losses bit for bit, loads for inference
and export, and its faults (a flipped bit in engine.json, a deleted manifest) are refused as before."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron.checkpoint.format1 import MANIFEST_MARK
from megatron.checkpoint.layout import ENGINE_FILE, MANIFEST_FILE
from megatron.checkpoint.manifest import FORMAT_VERSION, json_checksum
from megatron.checkpoint.verify import read_checkpoint
from megatron.errors import CheckpointError
from megatron.hf.to_hf import export_to_hf
from megatron.inference.checkpoint_model import load_model
from megatron.parallel import single_process_grid
from megatron.tokenizer_spec import TokenizerSpec
from megatron.training.loop import Trainer
from tests.training_fixtures import FORMAT1_CHECKPOINT, FORMAT1_FLAGS, format1_checkpoint, tiny_config, write_corpus

SINGLE = single_process_grid(torch.device("cpu"))
ITERATION = "iter_0000002"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus"), documents=40)


def _resume(corpus: str, folder: Path, save: Path | None = None) -> Trainer:
    flags = {**FORMAT1_FLAGS, "save": str(save) if save else None}
    return Trainer(tiny_config(corpus, train_iters=4, load=str(folder), **flags), SINGLE)


def test_the_fixture_reads_into_the_format_2_record():
    record = read_checkpoint(FORMAT1_CHECKPOINT / ITERATION)
    assert record.format_version == 1 and ENGINE_FILE in record.files
    assert record.run is not None and record.run.iteration == 2 and record.run.consumed_samples == 4
    assert record.run.model.hidden_size == 16 and record.run.model.experts_per_layer == [1, 2]
    assert record.run.tokenizer == TokenizerSpec("NullTokenizer", vocab_size=61, null_tokenizer_eod="last")
    assert record.run.tokenizer_size == 61 and record.run.training_data == ["corpus/corpus_text_document"]
    assert record.layout.world_size == 1 and record.layout.pipeline_parallel_size is None  # format 1 lacked it
    assert record.engine.global_steps == 2 and record.engine.client_state == {}
    assert (record.zero_stage, record.precision) == (0, "fp32")


def test_the_fixture_resumes_to_the_old_codes_losses_and_saves_format_2(corpus, tmp_path):
    expected = json.loads((FORMAT1_CHECKPOINT / "expected.json").read_text())
    trainer = _resume(corpus, format1_checkpoint(tmp_path / "old"), save=tmp_path / "new")
    result = trainer.train()
    assert result.losses == expected["losses"]
    # the evaluation's reductions round differently under AVX2 and AVX-512 kernels (seen on an AMD
    # EPYC against the fixture's Intel run: 4.7944498 vs 4.7944503); the training losses are exact on both
    assert [iteration for iteration, _ in result.validation] == [iteration for iteration, _ in expected["validation"]]
    assert [loss for _, loss in result.validation] == pytest.approx(
        [loss for _, loss in expected["validation"]], rel=1e-6
    )
    saved = read_checkpoint(tmp_path / "new" / "iter_0000004")
    assert saved.format_version == FORMAT_VERSION and not (tmp_path / "new" / "iter_0000004" / ENGINE_FILE).exists()
    assert saved.run.tokenizer == read_checkpoint(FORMAT1_CHECKPOINT / ITERATION).run.tokenizer


def test_the_fixture_loads_for_inference_with_its_saved_weights():
    loaded = load_model(FORMAT1_CHECKPOINT)
    saved = load_file(str(FORMAT1_CHECKPOINT / ITERATION / "model_rank00000.safetensors"))
    assert loaded.iteration == 2 and (loaded.tokenizer.vocab_size, loaded.tokenizer.eod) == (61, 60)
    assert torch.equal(loaded.model.word_embeddings.weight, saved["word_embeddings.weight"])
    state = loaded.model.state_dict()
    dense = [name for name in saved if name in state]
    assert len(dense) > 10 and all(torch.equal(state[name], saved[name]) for name in dense)


def test_the_export_reads_the_fixtures_model_and_refuses_it_as_any_layernorm_moe(tmp_path):
    """Its model (LayerNorm, learned positions, MoE) has no Hugging Face class: the export refuses it
    for that, having read the format-1 model config, and writes nothing."""
    with pytest.raises(CheckpointError, match="Qwen3-MoE, has no equivalent of its LayerNorm"):
        export_to_hf(str(FORMAT1_CHECKPOINT), str(tmp_path / "hf"), log=lambda line: None)
    assert not (tmp_path / "hf").exists()


def test_a_flipped_bit_in_a_format_1_engine_json_is_refused_naming_it(corpus, tmp_path):
    folder = format1_checkpoint(tmp_path / "ckpt")
    engine_json = folder / ITERATION / ENGINE_FILE
    data = bytearray(engine_json.read_bytes())
    data[len(data) // 2] ^= 0x10
    engine_json.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"engine.json fails its checksum"):
        _resume(corpus, folder)


def test_a_format_1_folder_without_its_manifest_is_refused(corpus, tmp_path):
    folder = format1_checkpoint(tmp_path / "ckpt")
    assert MANIFEST_MARK in json.loads((folder / ITERATION / ENGINE_FILE).read_text())
    (folder / ITERATION / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointError, match="has no manifest.json although the version that saved it writes one"):
        _resume(corpus, folder)


def test_a_manifest_of_a_newer_format_is_refused_naming_both(corpus, tmp_path):
    save = tmp_path / "ckpt"
    Trainer(tiny_config(corpus, train_iters=2, save=str(save), **FORMAT1_FLAGS), SINGLE).train()
    path = save / ITERATION / MANIFEST_FILE
    raw = {**json.loads(path.read_text()), "format_version": FORMAT_VERSION + 1, "a_later_field": 1}
    path.write_text(json.dumps({**raw, "checksum": json_checksum(raw)}))
    with pytest.raises(
        CheckpointError, match=f"has checkpoint format {FORMAT_VERSION + 1} but this version reads up to 2"
    ):
        _resume(corpus, save)


def test_a_flipped_bit_in_a_format_2_manifest_is_refused_before_any_field_is_read(corpus, tmp_path):
    save = tmp_path / "ckpt"
    Trainer(tiny_config(corpus, train_iters=2, save=str(save), **FORMAT1_FLAGS), SINGLE).train()
    path = save / ITERATION / MANIFEST_FILE
    text = path.read_text()
    for field in ('"hidden_size": 16', '"global_steps": 2', '"tokenizer_type": "NullTokenizer"'):
        edited = text.replace(field, field.replace("16", "17").replace("2", "3").replace("Null", "Nulm"))
        assert edited != text
        path.write_text(edited)
        with pytest.raises(CheckpointError, match="manifest.json is damaged \\(its own checksum does not match\\)"):
            _resume(corpus, save)
    path.write_text(text)
    assert _resume(corpus, save).iteration == 2
