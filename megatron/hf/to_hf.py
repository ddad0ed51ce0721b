"""Export: a checkpoint of ours -> a folder that transformers' AutoModelForCausalLM and
AutoTokenizer load with no extra code: config.json, the tokenizer files, and the weights as
save_pretrained writes them (model.safetensors, or model-0000i-of-0000n.safetensors shards of at
most --max-shard-size with model.safetensors.index.json), converted one tensor at a time.

The vocabulary keeps its padded rows (--make-vocab-size-divisible-by): config.json's vocab_size
is the embedding's, larger than the tokenizer's, as in GPT-NeoX's and Qwen's own checkpoints, so
the logits are ours to the last column. The folder is written as new_folder.py says: the disk
checked for every file up front, SAVE.tmp renamed at the end. A NaN or an infinity is refused.
"""

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import torch

from megatron.checkpoint.durable import fsync_path
from megatron.checkpoint.layout import MODEL, rank_files
from megatron.checkpoint.reader import saved_run
from megatron.checkpoint.tensor_file import Planned, write_tensor_file
from megatron.checkpoint.tensors import pack_by_size
from megatron.data.tokenizer import Tokenizer, tokenizer_of
from megatron.errors import CheckpointError
from megatron.hf.architectures import choose_spec, hf_config
from megatron.hf.link_runner import LinkRunner, plan
from megatron.hf.new_folder import FILE_ALLOWANCE, new_folder, refuse_existing_target
from megatron.hf.our_checkpoint import check_entries, expected_entries
from megatron.hf.safetensors_io import INDEX_FILE, TensorIndex
from megatron.hf.tensor_maps import model_links
from megatron.hf.tokenizer_check import compare, probe_texts, training_texts
from megatron.hf.tokenizer_files import export_tokenizer, exported_tokenizer_bytes
from megatron.inference.checkpoint_model import TOKENIZER_FILE_FLAGS, with_moved_files
from megatron.inference.mode import inference_config
from megatron.parallel import single_process_grid

Log = Callable[[str], None]


def shard_name(index: int, count: int) -> str:
    return "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def weight_map(shards: list[list[Planned]]) -> dict[str, str]:
    """model.safetensors.index.json's weight_map: each tensor's file."""
    return dict(
        sorted((entry.name, shard_name(number, len(shards))) for number, shard in enumerate(shards) for entry in shard)
    )


def export_to_hf(
    load: str,
    save: str,
    ckpt_step: int | None = None,
    max_shard_bytes: int = 5 * 10**9,
    dtype: torch.dtype | None = None,
    tokenizer_overrides: dict[str, str | None] | None = None,
    log: Log = print,
) -> Path:
    """Export checkpoint `load` (iteration `ckpt_step`, else the latest) into the new folder `save`,
    its floating-point tensors cast to `dtype` if given; returns the folder."""
    out = Path(save)
    refuse_existing_target(out)
    saved = saved_run(load, single_process_grid(torch.device("cpu")), ckpt_step)
    folder = saved.folder
    config = inference_config(saved.run.model)  # dropless, as ours infers
    spec = choose_spec(config, str(folder))
    recorded = with_moved_files(saved.run.tokenizer, tokenizer_overrides)
    tokenizer = tokenizer_of(recorded)
    files = {name: getattr(recorded, name) for name in TOKENIZER_FILE_FLAGS}
    with TensorIndex(rank_files(folder, MODEL)) as index:
        check_entries(
            index.info,
            expected_entries(config),
            str(folder),
            "the checkpoint does not hold the model its own config describes; export another iteration",
        )
        links = model_links(config, spec.family, spec.model_type, dtype or index.info["word_embeddings.weight"].dtype)
        shards = pack_by_size(plan(links, True, index.info, dtype), lambda entry: entry.info.nbytes, max_shard_bytes)
        total = sum(entry.info.nbytes for shard in shards for entry in shard)
        index_text = (
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map(shards)}, indent=2) + "\n"
            if len(shards) > 1
            else ""
        )
        needed = (
            total
            + exported_tokenizer_bytes(recorded.tokenizer_type, files, tokenizer)
            + len(index_text)
            + FILE_ALLOWANCE * (len(shards) + 4)  # config.json, tokenizer_config.json, tokenizer.json, the index
        )
        runner = LinkRunner(
            links, True, index, dtype, f"so {folder} was not exported; export another iteration (--ckpt-step)"
        )
        with new_folder(out, needed, "the export", log) as staging:
            tokens = export_tokenizer(
                recorded.tokenizer_type, files, tokenizer, staging, config.max_position_embeddings
            )
            check_tokenizer(tokenizer, staging, saved.run.training_data, log)
            stored = str(shards[0][0].info.dtype).removeprefix("torch.")
            (staging / "config.json").write_text(
                json.dumps({**hf_config(spec, config, tokens), "dtype": stored}, indent=2) + "\n"
            )
            for number, shard in enumerate(shards):
                shard_path = staging / shard_name(number, len(shards))
                write_tensor_file(shard_path, shard, runner, metadata={"format": "pt"})
                fsync_path(shard_path)
                log(f" > wrote {shard_name(number, len(shards))} ({sum(e.info.nbytes for e in shard):,} bytes)")
            if index_text:
                (staging / INDEX_FILE).write_text(index_text)
    log(
        f" > exported {folder} as {spec.name} ({spec.hf_class}, {total:,} bytes in {len(shards)} file"
        f"{'s' if len(shards) > 1 else ''}, vocabulary {config.vocab_size} rows for a tokenizer of "
        f"{tokenizer.vocab_size}) to {out}"
    )
    return out


def check_tokenizer(tokenizer: Tokenizer, folder: Path, data_paths: list[str] | None, log: Log) -> None:
    """The exported tokenizer must give our ids, and our text back, on the probe texts and on
    documents of the training data (`data_paths`, as --data-path); checked where transformers is
    installed."""
    if importlib.util.find_spec("transformers") is None:
        log(" > transformers is not installed, so the exported tokenizer was not checked against ours")
        return
    probes, documents = probe_texts(tokenizer), training_texts(data_paths, tokenizer, log)
    comparison = compare(tokenizer, folder, probes + documents)
    if comparison.difference:
        raise CheckpointError(
            f"the exported tokenizer does not match the checkpoint's: {comparison.difference}; "
            "nothing was written (export with the tokenizer files the model was trained with)"
        )
    agreed = f"{len(probes)} probe texts and {len(documents)} documents of the training data"
    if comparison.unknown_rendering:
        log(
            f" > the exported tokenizer gives our ids and text on {agreed}, but for the unknown piece, which it "
            f"renders as {comparison.unknown_rendering}"
        )
    else:
        log(f" > the exported tokenizer gives our ids and text on {agreed}")
