"""A trained model and its tokenizer, rebuilt from a checkpoint of this toolkit alone: the model
config and the tokenizer are in the checkpoint's manifest (checkpoint/reader.py reads it and the
weights), so a checkpoint saved with any expert-parallel size loads with any other.
"""

import argparse
import os
from dataclasses import dataclass, replace
from pathlib import Path

from megatron.checkpoint.reader import build_saved_model, saved_run
from megatron.data.tokenizer import Tokenizer, tokenizer_of
from megatron.inference.mode import inference_config
from megatron.model import GPTConfig, GPTModel
from megatron.parallel import ParallelGrid, build_parallel_grid, single_process_grid
from megatron.tokenizer_spec import TokenizerSpec

TOKENIZER_FILE_FLAGS = ("tokenizer_model", "vocab_file", "merge_file")


@dataclass(frozen=True)
class LoadedModel:
    model: GPTModel  # in eval mode, MoE dropless
    tokenizer: Tokenizer
    config: GPTConfig
    iteration: int
    folder: Path


def with_moved_files(spec: TokenizerSpec, overrides: dict[str, str | None] | None) -> TokenizerSpec:
    """The training run's tokenizer spec with the file paths in `overrides` that moved since training."""
    moved = {name: path for name, path in (overrides or {}).items() if name in TOKENIZER_FILE_FLAGS and path}
    return replace(spec, **moved)


def tokenizer_from_spec(spec: TokenizerSpec, overrides: dict[str, str | None] | None = None) -> Tokenizer:
    """The training run's tokenizer; `overrides` replace file paths that moved since training."""
    return tokenizer_of(with_moved_files(spec, overrides))


def load_model(
    load_dir: str | Path,
    grid: ParallelGrid | None = None,
    iteration: int | None = None,
    tokenizer_overrides: dict[str, str | None] | None = None,
) -> LoadedModel:
    """Build the saved model on `grid` (experts split over its expert-parallel group) and load it."""
    grid = grid or single_process_grid()
    saved = saved_run(load_dir, grid, iteration)
    tokenizer = tokenizer_from_spec(saved.run.tokenizer, tokenizer_overrides)
    config = inference_config(saved.run.model)
    return LoadedModel(
        build_saved_model(saved.folder, config, grid), tokenizer, config, saved.run.iteration, saved.folder
    )


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
