"""`tools/generate.py`: text from a checkpoint, for prompts given as a flag, read from a file (one
per line) or typed interactively. Runs on one process, or under torchrun with the experts split
over the ranks (every rank runs the same prompts; rank 0 prints)."""

import argparse
import os
import sys
from collections.abc import Iterator

import torch

from megatron.config.parser import FlagParser, non_negative_float, non_negative_int, positive_float, positive_int
from megatron.entry_point import run_entry_point
from megatron.errors import ConfigError
from megatron.inference.checkpoint_model import (
    LoadedModel,
    add_load_args,
    inference_grid,
    load_from_args,
)
from megatron.inference.generation import generate
from megatron.inference.sampling import SamplingConfig


def build_parser() -> FlagParser:
    parser = FlagParser(description="Generate text from a checkpoint of pretrain_gpt.py.")
    add_load_args(parser)
    g = parser.add_argument_group("prompts (neither flag: type prompts interactively)")
    source = g.add_mutually_exclusive_group()
    source.add_argument("--prompt", action="append", default=None, help="a prompt; repeat for several")
    source.add_argument("--prompt-file", default=None, help="a text file with one prompt per line")
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=positive_int, default=64)
    g.add_argument("--temperature", type=non_negative_float, default=1.0, help="0: greedy")
    g.add_argument("--top-k", type=non_negative_int, default=0, help="sample among the k most likely tokens; 0: all")
    g.add_argument(
        "--top-p", type=positive_float, default=1.0, help="sample among the most likely tokens holding this mass"
    )
    g.add_argument("--seed", type=int, default=1234)
    return parser


def prompts(args: argparse.Namespace, distributed: bool) -> Iterator[str]:
    if args.prompt is not None:
        yield from args.prompt
    elif args.prompt_file is not None:
        if not os.path.isfile(args.prompt_file):
            raise ConfigError(
                f"--prompt-file {args.prompt_file} does not exist; pass a text file with one prompt per line"
            )
        with open(args.prompt_file, encoding="utf-8") as f:
            yield from (line.rstrip("\n") for line in f if line.strip())
    elif distributed:
        raise ConfigError("interactive prompts need a single process; under torchrun pass --prompt or --prompt-file")
    else:
        print("Type a prompt and press Enter (an empty line or Ctrl-D ends).", flush=True)
        while (line := _read_line()) is not None:
            yield line


def _read_line() -> str | None:
    try:
        line = input("prompt> ")
    except EOFError:
        return None
    return line or None


def complete(loaded: LoadedModel, prompt: str, args: argparse.Namespace, generator: torch.Generator) -> str:
    """The prompt and its continuation, decoded together so word boundaries come out right."""
    tokenizer = loaded.tokenizer
    ids = tokenizer.tokenize(prompt) or [tokenizer.eod]  # an empty prompt: start a new document
    prompt_1S = torch.tensor([ids], device=loaded.model.word_embeddings.weight.device)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    new = generate(
        loaded.model, prompt_1S, args.max_new_tokens, tokenizer.eod, sampling, tokenizer.vocab_size, generator
    )
    return tokenizer.detokenize(ids + new[0])


def main(argv: list[str] | None = None) -> None:
    run_entry_point(lambda: run(build_parser().parse_args(argv)))  # a bad flag is one sentence too


def run(args: argparse.Namespace) -> None:
    SamplingConfig(args.temperature, args.top_k, args.top_p)  # bad flags stop before loading
    grid = inference_grid()
    loaded = load_from_args(args, grid)
    generator = torch.Generator(device=grid.device).manual_seed(args.seed)
    if grid.is_first_rank:
        print(f" > loaded {loaded.folder} (iteration {loaded.iteration})", file=sys.stderr, flush=True)
    for prompt in prompts(args, grid.world_size > 1):
        text = complete(loaded, prompt, args, generator)
        if grid.is_first_rank:
            print(f"{text}\n", flush=True)
