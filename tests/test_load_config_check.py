"""--load compares the checkpoint's model config with the run's, field by field: a shape change is
refused with one sentence naming the field, both values and the flag (on a resume and under
--reset-iteration), a change of meaning is refused on a resume, and the settings a resumed run may
change are logged in one line. Faults are made for real: saved with one config, loaded with another."""

import json
from pathlib import Path

import pytest
import torch

from megatron.checkpoint.format1 import ManifestV1
from megatron.checkpoint.layout import ENGINE_FILE, MANIFEST_FILE
from megatron.checkpoint.model_config import RULES, config_field_names
from megatron.errors import CheckpointError
from megatron.parallel import single_process_grid
from megatron.training.loop import Trainer
from tests.test_model_options import NEW_FIELDS
from tests.training_fixtures import (
    FORMAT1_FLAGS,
    as_saved_before_manifests,
    format1_checkpoint,
    tiny_config,
    write_corpus,
)

SINGLE = single_process_grid(torch.device("cpu"))
MOE = {"num_experts": 2, "lr_warmup_iters": 1}  # layer 2 of 2 is an MoE layer
# fields added to the model config after the first checkpoints: older ones do not record them
LATER_FIELDS = (
    *NEW_FIELDS,
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "mlp_type",
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def saved(corpus, tmp_path_factory) -> Path:
    """An MoE checkpoint at iteration 2 (learned positions, 4 heads, 2 layers, top-1)."""
    folder = tmp_path_factory.mktemp("saved") / "ckpt"
    Trainer(tiny_config(corpus, train_iters=2, save=str(folder), **MOE), SINGLE).train()
    return folder


def test_every_model_config_field_is_compared_or_allowed():
    covered = {name for rule in RULES for name in rule.covers}
    assert covered == config_field_names()


@pytest.mark.parametrize(
    "change, expected",
    [
        (
            {"num_layers": 1},
            "num_layers 2 but this run has 1, so it cannot be loaded into this model; give --num-layers 2",
        ),
        (
            {"num_attention_heads": 2},
            "num_attention_heads 4 but this run has 2, so it cannot be loaded into this model; "
            "give --num-attention-heads 4",
        ),
        (
            {"position_embedding_type": "rope"},
            "position_embedding_type learned_absolute but this run has rope, so it "
            "cannot be loaded into this model; give --position-embedding-type learned_absolute",
        ),
        ({"make_vocab_size_divisible_by": 64}, "padded vocabulary size 128 but this run has 64"),
        ({"num_experts": 4}, "experts per layer [1, 2] but this run has [1, 4]"),
        ({"max_position_embeddings": 32}, "max_position_embeddings 16 but this run has 32"),
    ],
    ids=["fewer-layers", "head-count", "rope-for-learned", "padded-vocabulary", "expert-count", "positions"],
)
@pytest.mark.parametrize("reset_iteration", [False, True], ids=["resume", "reset-iteration"])
def test_a_shape_change_is_refused_naming_the_field_both_values_and_the_flag(
    corpus, saved, change, expected, reset_iteration
):
    config = tiny_config(corpus, train_iters=4, load=str(saved), reset_iteration=reset_iteration, **{**MOE, **change})
    with pytest.raises(CheckpointError) as refused:
        Trainer(config, SINGLE)
    message = str(refused.value)
    assert message.startswith(f"the checkpoint {saved / 'iter_0000002'} was saved with {expected}")
    assert message.endswith("to load it") and "\n" not in message


def test_a_change_of_meaning_is_refused_on_resume_and_logged_under_reset_iteration(corpus, saved, capsys):
    with pytest.raises(
        CheckpointError,
        match=r"saved with norm_epsilon 1e-05 but this run has 1e-06, so it cannot be resumed into this model; "
        r"give --norm-epsilon 1e-05 to load it, or --reset-iteration to start a new run from its weights",
    ):
        Trainer(tiny_config(corpus, train_iters=4, load=str(saved), norm_epsilon=1e-6, **MOE), SINGLE)
    capsys.readouterr()
    fresh = Trainer(
        tiny_config(corpus, train_iters=2, load=str(saved), reset_iteration=True, norm_epsilon=1e-6, **MOE), SINGLE
    )
    assert "this run changes norm_epsilon 1e-05 -> 1e-06 (allowed" in capsys.readouterr().out
    assert fresh.train().iteration == 2


def test_settings_a_resume_may_change_are_logged_in_one_line_and_it_trains(corpus, saved, tmp_path, capsys):
    changed = {"topk": 2, "hidden_dropout": 0.0, "moe_train_capacity_factor": 2.0, "lr": 1e-3}
    capsys.readouterr()
    resumed = Trainer(tiny_config(corpus, train_iters=4, load=str(saved), save=str(tmp_path), **MOE, **changed), SINGLE)
    lines = [line for line in capsys.readouterr().out.splitlines() if "this run changes" in line]
    assert len(lines) == 1
    for change in ("moe.topk 1 -> 2", "hidden_dropout 0.1 -> 0.0", "moe.train_capacity_factor 1.0 -> 2.0"):
        assert change in lines[0]
    result = resumed.train()
    assert resumed.iteration == 4 and result.losses and all(loss == loss for loss in result.losses)


def test_a_resume_with_the_same_model_logs_no_change(corpus, saved, capsys):
    capsys.readouterr()
    resumed = Trainer(tiny_config(corpus, train_iters=4, load=str(saved), **MOE), SINGLE)
    assert resumed.iteration == 2 and "this run changes" not in capsys.readouterr().out


def _older_model_config(model: dict) -> dict:
    """The config as an earlier version recorded it: later fields absent, the epsilon's old name."""
    older = {name: value for name, value in model.items() if name not in LATER_FIELDS}
    older["layernorm_epsilon"] = older.pop("norm_epsilon")
    older["moe"] = {name: value for name, value in model["moe"].items() if not name.startswith("router_")}
    return older


def _rewrite_v1_manifest(folder: Path, model: dict) -> None:
    """The format-1 manifest of `folder` recording `model`, its own checksum made anew."""
    path = folder / MANIFEST_FILE
    v1 = ManifestV1.model_validate_json(path.read_text())
    edited = v1.model_copy(update={"run": v1.run.model_copy(update={"model": model})})
    path.write_text(edited.model_copy(update={"checksum": edited.own_checksum()}).model_dump_json(indent=1))


def test_a_format_1_manifest_recording_fewer_fields_loads(corpus, tmp_path, capsys):
    folder = format1_checkpoint(tmp_path / "ckpt")
    iteration = folder / "iter_0000002"
    _rewrite_v1_manifest(
        iteration, _older_model_config(json.loads((iteration / MANIFEST_FILE).read_text())["run"]["model"])
    )
    capsys.readouterr()
    resumed = Trainer(tiny_config(corpus, train_iters=4, load=str(folder), **FORMAT1_FLAGS), SINGLE)
    assert resumed.iteration == 2 and "this run changes" not in capsys.readouterr().out
    with pytest.raises(CheckpointError, match="saved with num_attention_heads 2 but this run has 1"):
        Trainer(
            tiny_config(corpus, train_iters=4, load=str(folder), **{**FORMAT1_FLAGS, "num_attention_heads": 1}), SINGLE
        )


def test_a_checkpoint_from_before_manifests_recording_fewer_fields_loads(corpus, tmp_path, capsys):
    folder = format1_checkpoint(tmp_path / "ckpt")
    as_saved_before_manifests(folder / "iter_0000002")
    engine_json = folder / "iter_0000002" / ENGINE_FILE
    meta = json.loads(engine_json.read_text())
    meta["client_state"]["model_config"] = _older_model_config(meta["client_state"]["model_config"])
    engine_json.write_text(json.dumps(meta))
    capsys.readouterr()
    resumed = Trainer(tiny_config(corpus, train_iters=4, load=str(folder), **FORMAT1_FLAGS), SINGLE)
    out = capsys.readouterr().out
    assert resumed.iteration == 2 and "has no manifest.json (saved by an earlier version)" in out
    assert "this run changes" not in out
    with pytest.raises(CheckpointError, match="saved with num_layers 2 but this run has 1"):
        Trainer(tiny_config(corpus, train_iters=4, load=str(folder), **{**FORMAT1_FLAGS, "num_layers": 1}), SINGLE)
