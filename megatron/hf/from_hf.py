"""Import: a Hugging Face folder (config.json and safetensors weights, as save_pretrained writes them)
-> a weights-only checkpoint of ours to continue pretraining from (our_checkpoint.py says how to
load it), converted one tensor at a time.

The model config is built from config.json (config_import.py), and the flags printed at the end
(and saved in the checkpoint as its command line) are printed from it (config/model_flags.py), so
that they build the same model for training. The vocabulary keeps the checkpoint's rows:
--make-vocab-size-divisible-by is chosen so that our padding of the tokenizer's vocabulary gives exactly
that many (the largest power of two up to 128 that does, else the row count itself). Tensors keep
their dtype unless --dtype says otherwise (our training keeps fp32 weights and reads any dtype), so
hf -> ours -> hf is bit-identical. Before anything is written every tensor is checked there and of
the shape config.json calls for (source_shapes.py), and the disk for room; --save is then written
as new_folder.py says (all of it or nothing), a NaN or an infinity in a weight refused.
"""

import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from megatron.checkpoint.layout import iteration_tag
from megatron.checkpoint.manifest import RunRecord
from megatron.checkpoint.tensor_file import Planned
from megatron.config.model_flags import model_flags, tokenizer_flags
from megatron.data.tokenizer import padded_vocab_size
from megatron.errors import CheckpointError, ConfigError
from megatron.hf.architectures import Spec, choose_spec
from megatron.hf.config_import import config_from_hf, moe_layout
from megatron.hf.link_runner import LinkRunner, plan
from megatron.hf.new_folder import FILE_ALLOWANCE, new_folder, refuse_existing_target
from megatron.hf.our_checkpoint import checkpoint_bytes, expected_entries, write_weights_checkpoint
from megatron.hf.routing import routing_of
from megatron.hf.safetensors_io import INDEX_FILE, TensorIndex
from megatron.hf.source_shapes import refuse_wrong_shapes
from megatron.hf.tensor_maps import Link, model_links
from megatron.hf.tokenizer_files import ImportedTokenizer, copy_tokenizer_files, import_tokenizer
from megatron.inference.mode import inference_config
from megatron.model import GPTConfig

Log = Callable[[str], None]
TOKENIZER_FOLDER = "tokenizer"  # in --save: the copies of the tokenizer files
# tensors a Hugging Face checkpoint may hold that no model computes with: GPT-2's attention-mask
# buffers, rotary tables saved by old versions, multi-token-prediction layers past the last layer
IGNORED = (re.compile(r".*\.attn\.(masked_)?bias"), re.compile(r".*rotary_emb\.inv_freq"))


def weight_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / INDEX_FILE
    if index.is_file():
        files = [hf_dir / name for name in sorted(set(read_weight_map(index).values()))]
        missing = [path for path in files if not path.is_file()]
        if missing:
            raise CheckpointError(f"{missing[0]} is missing, though {index.name} names it; give the whole folder")
        return files
    files = sorted(hf_dir.glob("*.safetensors"))
    if files:
        return files
    if any(hf_dir.glob("*.bin")) or any(hf_dir.glob("*.pt")):
        raise CheckpointError(
            f"{hf_dir} holds its weights as PyTorch pickles, which this converter does not read "
            "(nothing here is unpickled); save the model with save_pretrained(safe_serialization=True)"
        )
    raise CheckpointError(f"{hf_dir} holds no safetensors weights; give the folder save_pretrained wrote")


def read_weight_map(index: Path) -> dict[str, str]:
    """The weight_map (tensor name -> file name) of a model.safetensors.index.json."""
    fix = "replace it with the one save_pretrained wrote beside the shards"
    try:
        content = json.loads(index.read_bytes())
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{index} is not JSON ({error}); {fix}") from None
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
        raise CheckpointError(f"{index} has no weight_map of tensor names to file names; {fix}")
    return weight_map


def vocab_divisor(tokens: int, rows: int) -> int:
    """The --make-vocab-size-divisible-by that pads `tokens` ids to exactly `rows`."""
    return next((d for d in (128, 64, 32, 16, 8, 4, 2, 1) if padded_vocab_size(tokens, d) == rows), rows)


def read_hf_config(hf_dir: Path) -> Any:
    try:
        from transformers import AutoConfig
    except ImportError:
        raise CheckpointError(
            "importing a Hugging Face model reads its config with transformers; pip install transformers"
        ) from None
    if not (hf_dir / "config.json").is_file():
        raise CheckpointError(f"{hf_dir} has no config.json; give the folder save_pretrained wrote")
    try:
        return AutoConfig.from_pretrained(str(hf_dir))
    except (ValueError, KeyError, OSError) as error:
        raise CheckpointError(
            f"{hf_dir / 'config.json'} is not a config transformers reads ({error}); "
            "give the folder save_pretrained wrote"
        ) from None


def check_same_model(config: GPTConfig, spec: Spec, hf: Any, hf_dir: Path) -> None:
    """The model built must export back to the same class, router and layer layout."""
    try:
        chosen = choose_spec(inference_config(config), str(hf_dir))
        problem = None if chosen is spec else f"it would export as {chosen.name}"
    except CheckpointError as error:
        problem = f"it would not export back ({error})"
    if problem is None and spec.moe:
        layout = moe_layout(hf, spec)
        if routing_of(config.moe) != layout.routing:
            problem = f"its router would compute {routing_of(config.moe)} instead of {layout.routing}"
        elif tuple(config.experts_per_layer) != layout.experts_per_layer:
            problem = f"its MoE layers would be {config.experts_per_layer} instead of {list(layout.experts_per_layer)}"
    if problem:
        raise CheckpointError(f"{hf_dir} was not imported: {problem} (a converter fault: please report it)")


def unused_tensors(found: set[str], used: set[str], config: GPTConfig) -> list[str]:
    """What the Hugging Face files hold that the model does not use, beyond what is known to be unused."""
    head = {"lm_head.weight", "embed_out.weight"} if not config.untie_embeddings_and_output_weights else set()
    layer = re.compile(r".*layers\.(\d+)\.")

    def ignored(name: str) -> bool:
        past_last = (match := layer.match(name)) is not None and int(match.group(1)) >= config.num_layers
        return name in head or past_last or any(pattern.fullmatch(name) for pattern in IGNORED)

    return sorted(name for name in found - used if not ignored(name))


@dataclass(frozen=True)
class Imported:
    folder: Path  # the checkpoint's iteration folder
    flags: list[str]  # pretrain_gpt.py's flags for the model and its tokenizer


@dataclass(frozen=True)
class Conversion:
    """What an import writes, worked out (and checked) before anything is."""

    links: list[Link]
    planned: list[Planned]
    tokenizer: ImportedTokenizer
    flags: list[str]
    run: RunRecord


def import_from_hf(
    hf_dir: str, save: str, ep_size: int = 1, dtype: torch.dtype | None = None, log: Log = print
) -> Imported:
    """Convert the Hugging Face folder `hf_dir` into the new checkpoint directory `save`, written
    as new_folder.py says (all of it or nothing; a NaN or an infinity in a weight is refused)."""
    source, target = Path(hf_dir), Path(save)
    refuse_existing_target(target)
    hf = read_hf_config(source)
    spec, model = config_from_hf(hf, str(source))
    with TensorIndex(weight_files(source)) as index:
        conversion = plan_import(source, target, hf, spec, model, index, ep_size, dtype)
        tokenizer = conversion.tokenizer
        needed = checkpoint_bytes(conversion.planned) + tokenizer.nbytes + FILE_ALLOWANCE * len(tokenizer.files)
        refusal = (
            f"so {source} was not imported; replace the file with an intact copy, or repair the model and save it again"
        )
        runner = LinkRunner(conversion.links, False, index, dtype, refusal)
        with new_folder(target, needed, "the import", log) as staging:
            copy_tokenizer_files(tokenizer, staging / TOKENIZER_FOLDER)
            write_weights_checkpoint(staging, conversion.planned, runner, conversion.run, ep_size)
    folder, flags = target / iteration_tag(0), conversion.flags
    if tokenizer.note:
        log(f" > note: {tokenizer.note}")
    log(
        f" > imported {source} ({spec.name}) into {folder}; continue pretraining with these flags and your data, "
        f"batch and schedule flags:\n{shlex.join(flags)} --load {shlex.quote(str(target))}"
    )
    return Imported(folder, flags)


def plan_import(
    source: Path,
    target: Path,
    hf: Any,
    spec: Spec,
    model: GPTConfig,
    index: TensorIndex,
    ep_size: int,
    dtype: torch.dtype | None,
) -> Conversion:
    """Everything the import of `source` into `target` writes, checked: the tokenizer, the model
    `config_from_hf` built, every tensor there and of the shape config.json calls for. Nothing is written."""
    rows = hf.vocab_size
    tokenizer = import_tokenizer(source, target / TOKENIZER_FOLDER, rows)
    ours = tokenizer.tokenizer
    if ours.vocab_size > rows:
        raise CheckpointError(
            f"{source}'s tokenizer has {ours.vocab_size} ids but its model only {rows} embedding rows; "
            "give the folder of a model and the tokenizer it was trained with"
        )
    config = replace(model, vocab_size=rows)
    flags = (
        model_flags(config)
        + tokenizer_flags(tokenizer.spec)
        + ["--make-vocab-size-divisible-by", str(vocab_divisor(ours.vocab_size, rows))]
    )
    if ep_size > 1:
        flags += ["--moe-expert-parallel-size", str(ep_size)]
    check_same_model(config, spec, hf, source)
    uneven = sorted({count for count in config.experts_per_layer if count > 1 and count % ep_size})
    if uneven:
        raise ConfigError(
            f"--moe-expert-parallel-size {ep_size} does not divide the {uneven[0]} experts of "
            f"{source}'s MoE layers; choose an expert-parallel size that divides it"
        )
    links = model_links(config, spec.family, spec.model_type, torch.float32)  # (the dtype of zeros only exports make)
    needed = {name for link in links for name in link.theirs}
    missing = sorted(needed - index.info.keys())
    if missing:
        fused = any(name.endswith("experts.gate_up_proj") for name in index.info)
        how = (
            "it stores the experts fused (gate_up_proj): save it with save_pretrained(save_original_format=True)"
            if fused
            else "give the folder save_pretrained wrote, with all its shards"
        )
        raise CheckpointError(f"{source} lacks {missing[0]}, which its config.json calls for; {how}")
    unused = unused_tensors(set(index.info), needed, config)
    if unused:
        raise CheckpointError(
            f"{source} holds {unused[0]}, which a {spec.name} model of its config.json does not "
            "use; give the folder of one model as save_pretrained wrote it"
        )
    refuse_wrong_shapes(links, expected_entries(config), index, source, hf)
    run = RunRecord(
        iteration=0,
        consumed_samples=0,
        consumed_tokens=0,
        model=config,
        tokenizer=tokenizer.spec,
        tokenizer_size=ours.vocab_size,
        converted_from=str(source.resolve()),
        command_line=shlex.join(flags),
    )
    return Conversion(links, plan(links, False, index.info, dtype), tokenizer, flags, run)
