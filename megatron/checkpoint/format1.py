"""Checkpoints saved before format 2, read into its records (manifest.py) so that nothing else
knows they differ. Format 1 is a manifest.json beside an engine.json whose client state holds the
training loop's record: the model config and the raw flags (the tokenizer's among them). Before
manifests existed a folder had the engine.json alone; it loads unverified. One whose engine.json
says its writer wrote a manifest (MANIFEST_WRITER_KEYS) is refused without it."""

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from megatron.checkpoint.checksum import bytes_checksum
from megatron.checkpoint.layout import ENGINE_FILE, MANIFEST_FILE
from megatron.checkpoint.manifest import (
    PRE_MANIFEST_FORMAT,
    DamagedCheckpoint,
    EngineRecord,
    FileRecord,
    LayoutRecord,
    LogWindowRecord,
    Manifest,
    RunRecord,
    StrictRecord,
)
from megatron.checkpoint.model_record import UnfitModelConfig, model_config_from_json, unfit
from megatron.errors import CheckpointError
from megatron.tokenizer_spec import NULL_EOD_EXTRA, TokenizerSpec

# engine.json's record that the checkpoint's writer wrote a manifest too, so that one missing was
# deleted and the folder is refused; one without any of these keys was saved before manifests
# existed and loads unverified. Besides the mark (every format-1 save):
# tensor_parallel_splits (every training save since tensor-parallel checkpoints, which came after
# manifests) and weights_only (the Hugging Face importer, which wrote a manifest from the start).
MANIFEST_MARK = "manifest_format"
MANIFEST_WRITER_KEYS = (MANIFEST_MARK, "tensor_parallel_splits", "weights_only")
# what the training loop (and the importer) kept in the client state; the rest is the caller's
LOOP_KEYS = ("iteration", "consumed_samples", "model_config", "flags", "log_window", "converted_from")
# what every format-1 engine.json holds of the engine's state (a folder lacking one is damaged)
ENGINE_KEYS = ("global_steps", "micro_steps", "skipped_steps", "optimizer_groups", "lr_scheduler", "loss_scaler")


class RunRecordV1(StrictRecord):
    iteration: int
    consumed_samples: int
    consumed_tokens: int
    model: dict[str, Any]
    tokenizer: dict[str, Any]


class ManifestV1(StrictRecord):
    """Format 1's manifest, field for field (its own checksum is over exactly this JSON)."""

    format_version: int
    run: RunRecordV1 | None
    world_size: int
    data_parallel_size: int
    expert_parallel_size: int
    zero_stage: int
    precision: str
    files: dict[str, FileRecord]
    checksum: str = ""

    def own_checksum(self) -> str:
        return bytes_checksum(self.model_dump_json(exclude={"checksum"}).encode())


def read_engine_meta(folder: Path) -> dict[str, Any]:
    """engine.json of a checkpoint folder, as a dict."""
    path = folder / ENGINE_FILE
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {folder} ({ENGINE_FILE} is missing); check --load and the iteration")
    try:
        meta = json.loads(path.read_bytes())
    except ValueError as error:
        raise DamagedCheckpoint(f"{path} is damaged ({error}); load an earlier checkpoint") from None
    if not isinstance(meta, dict):
        raise DamagedCheckpoint(f"{path} is damaged (it holds no JSON object); load an earlier checkpoint")
    return meta


def wrote_manifest(engine_file: Path) -> bool:
    """Whether engine.json records a writer of manifests (a damaged one is left to its reader)."""
    try:
        meta = json.loads(engine_file.read_bytes())
    except ValueError:
        return False
    return isinstance(meta, dict) and any(key in meta for key in MANIFEST_WRITER_KEYS)


def tokenizer_from_flags(flags: dict[str, Any]) -> TokenizerSpec:
    return TokenizerSpec(
        tokenizer_type=flags["tokenizer_type"],
        tokenizer_model=flags.get("tokenizer_model"),
        vocab_file=flags.get("vocab_file"),
        merge_file=flags.get("merge_file"),
        vocab_size=flags.get("vocab_size"),
        # checkpoints saved before --null-tokenizer-eod existed used the extra end-of-document id
        null_tokenizer_eod=flags.get("null_tokenizer_eod", NULL_EOD_EXTRA),
    )


def _run(client: dict[str, Any], v1: RunRecordV1 | None) -> RunRecord | None:
    """The loop's record from the client state (None when an engine alone saved the folder)."""
    if "model_config" not in client or "flags" not in client:
        return None
    flags = client["flags"]
    consumed_tokens = v1.consumed_tokens if v1 else client["consumed_samples"] * flags.get("seq_length", 0)
    window = client.get("log_window")
    return RunRecord(
        iteration=client["iteration"],
        consumed_samples=client["consumed_samples"],
        consumed_tokens=consumed_tokens,
        model=model_config_from_json(v1.model if v1 else client["model_config"]),
        tokenizer=tokenizer_from_flags(flags),
        tokenizer_size=v1.tokenizer.get("vocab_size") if v1 else None,
        log_window=None if window is None else LogWindowRecord(losses=window["losses"], skipped=window["skipped"]),
        converted_from=client.get("converted_from"),
        training_data=flags.get("data_path") or flags.get("train_data_path"),
    )


def upgraded(folder: Path, v1: ManifestV1 | None) -> Manifest:
    """The format-2 record of format-1 folder `folder` (`v1`: its manifest; None before manifests)."""
    path = folder / ENGINE_FILE
    meta = read_engine_meta(folder)
    try:
        client = meta.get("client_state") or {}
        run = _run(client, v1.run if v1 else None)
        engine = {
            **{key: meta[key] for key in ENGINE_KEYS},
            "tensor_parallel_splits": meta.get("tensor_parallel_splits") or {},
            "weights_only": meta.get("weights_only", False),
            "client_state": {key: value for key, value in client.items() if run is None or key not in LOOP_KEYS},
        }
        layout = LayoutRecord(
            world_size=v1.world_size if v1 else None,
            tensor_parallel_size=meta.get("tp_size"),
            pipeline_parallel_size=None,
            data_parallel_size=meta.get("dp_size"),
            expert_parallel_size=meta.get("ep_size"),
            expert_tensor_parallel_size=None,
        )
        return Manifest(
            format_version=v1.format_version if v1 else PRE_MANIFEST_FORMAT,
            run=run,
            layout=layout,
            engine=EngineRecord.model_validate_json(json.dumps(engine)),  # JSON's lists are the tuples here
            zero_stage=v1.zero_stage if v1 else None,
            precision=v1.precision if v1 else None,
            files=v1.files if v1 else {},
        )
    except UnfitModelConfig as error:
        raise unfit(folder / MANIFEST_FILE if v1 and v1.run else path, error) from None
    except KeyError as missing:
        raise DamagedCheckpoint(f"{path} lacks {missing}; load an earlier checkpoint") from None
    except (ValidationError, TypeError, AttributeError) as error:
        reason = str(error).splitlines()[0]
        raise DamagedCheckpoint(f"{path} is damaged ({reason}); load an earlier checkpoint") from None
