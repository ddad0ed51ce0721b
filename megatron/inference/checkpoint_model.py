"""A trained model and its tokenizer, rebuilt from a checkpoint of this toolkit alone: the model
config and the training flags (tokenizer settings) are in the checkpoint's engine.json, and the
weights are read by global name, so a checkpoint saved with any expert-parallel size loads with
any other (each rank reads only its own experts).
"""

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.checkpoint.iterations import read_latest
from megatron.checkpoint.layout import ENGINE_FILE, iteration_tag
from megatron.checkpoint.tensors import ShardedReader, load_model_entries
from megatron.checkpoint.verify import read_engine_meta, verify_folder
from megatron.data.tokenizer import NULL_EOD_EXTRA, Tokenizer, build_tokenizer
from megatron.errors import CheckpointError
from megatron.inference.mode import inference_config
from megatron.model import GPTConfig, GPTModel
from megatron.model.moe import MoEConfig
from megatron.model.tensor_parallel import TensorParallel
from megatron.parallel import ParallelGrid, build_parallel_grid, single_process_grid

TOKENIZER_FILE_FLAGS = ("tokenizer_model", "vocab_file", "merge_file")
# GPTConfig fields under the names older checkpoints saved them with
RENAMED_FIELDS = {"layernorm_epsilon": "norm_epsilon"}


@dataclass(frozen=True)
class LoadedModel:
    model: GPTModel  # in eval mode, MoE dropless
    tokenizer: Tokenizer
    config: GPTConfig
    iteration: int
    folder: Path


def checkpoint_folder(load_dir: str | Path, grid: ParallelGrid, iteration: int | None = None) -> Path:
    """`load_dir/iter_N/` for the given iteration, or the latest one, once its files verify."""
    if iteration is None:
        iteration, problem = read_latest(str(load_dir))
        if iteration is None:
            raise CheckpointError(f"{problem}; pass the --save directory of a training run, or --iteration N")
    folder = Path(load_dir) / iteration_tag(iteration)
    if not folder.is_dir():
        raise CheckpointError(f"no checkpoint at {folder}; check --load and --iteration")
    verify_folder(folder, grid)
    return folder


def read_client_state(folder: Path) -> dict[str, Any]:
    client = read_engine_meta(folder).get("client_state", {})
    if "model_config" not in client or "flags" not in client:
        raise CheckpointError(
            f"{folder / ENGINE_FILE} holds no model config or training flags; load a checkpoint saved by pretrain_gpt.py"
        )
    return client


def model_config_from_state(saved: dict[str, Any], folder: Path) -> GPTConfig:
    """The GPTConfig saved as a JSON object (tuples come back as lists, MoEConfig as an object).
    Fields added since take their defaults; renamed ones are read under their old names too."""
    renamed = {RENAMED_FIELDS.get(name, name): value for name, value in saved.items()}
    try:
        return GPTConfig(**{**renamed, "num_experts": tuple(saved["num_experts"]), "moe": MoEConfig(**saved["moe"])})
    except (TypeError, KeyError) as e:
        raise CheckpointError(
            f"the model config in {folder / ENGINE_FILE} does not fit this version's GPTConfig ({e}); "
            "load it with the toolkit version that saved it"
        ) from e


def tokenizer_from_flags(flags: dict[str, Any], overrides: dict[str, str | None] | None = None) -> Tokenizer:
    """The training run's tokenizer; `overrides` replace file paths that moved since training."""
    files = {name: (overrides or {}).get(name) or flags.get(name) for name in TOKENIZER_FILE_FLAGS}
    # Checkpoints saved before --null-tokenizer-eod existed used the extra end-of-document id.
    eod = flags.get("null_tokenizer_eod", NULL_EOD_EXTRA)
    return build_tokenizer(flags["tokenizer_type"], vocab_size=flags.get("vocab_size"), null_tokenizer_eod=eod, **files)


def load_model(
    load_dir: str | Path,
    grid: ParallelGrid | None = None,
    iteration: int | None = None,
    tokenizer_overrides: dict[str, str | None] | None = None,
) -> LoadedModel:
    """Build the saved model on `grid` (experts split over its expert-parallel group) and load it."""
    grid = grid or single_process_grid()
    folder = checkpoint_folder(load_dir, grid, iteration)
    client = read_client_state(folder)
    tokenizer = tokenizer_from_flags(client["flags"], tokenizer_overrides)
    config = inference_config(model_config_from_state(client["model_config"], folder))
    return LoadedModel(build_saved_model(folder, config, grid), tokenizer, config, int(client["iteration"]), folder)


def build_saved_model(
    folder: Path, config: GPTConfig, grid: ParallelGrid, tp: TensorParallel = TensorParallel()
) -> GPTModel:
    """`config`'s model on `grid` with the weights of checkpoint `folder`, in eval mode (each rank
    reads only its own experts, whatever expert-parallel size saved them, and under tensor
    parallelism `tp` its slices)."""
    model = GPTModel(config, ep_group=grid.ep_group, tp=tp)
    load_model_entries(model, ShardedReader(folder, "model"))
    return model.to(grid.device).eval()


def add_load_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpoint")
    g.add_argument("--load", required=True, help="checkpoint directory (the --save of a training run)")
    g.add_argument("--iteration", type=int, default=None, help="default: the latest checkpoint")
    g.add_argument("--tokenizer-model", default=None, help="override the saved SentencePiece model path")
    g.add_argument("--vocab-file", default=None, help="override the saved GPT-2 vocab.json path")
    g.add_argument("--merge-file", default=None, help="override the saved GPT-2 merges.txt path")


def load_from_args(args: argparse.Namespace, grid: ParallelGrid | None = None) -> LoadedModel:
    overrides = {name: getattr(args, name) for name in TOKENIZER_FILE_FLAGS}
    return load_model(args.load, grid, args.iteration, overrides)


def inference_grid() -> ParallelGrid:
    """One process, or under torchrun every rank in one expert-parallel group."""
    return build_parallel_grid(ep_size=int(os.environ.get("WORLD_SIZE", "1")))
