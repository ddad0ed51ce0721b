"""`tools/checkpoint/convert.py`: checkpoints to and from Hugging Face transformers.

    --to hf   --load CKPT [--ckpt-step N] --save DIR   a folder AutoModelForCausalLM and
              AutoTokenizer load (GPT-2, GPT-NeoX, Llama, Qwen3, Mixtral, Qwen3-MoE, Qwen2-MoE or
              GLM-4-MoE, whichever computes the model exactly; a model none computes is refused)
    --from hf --load HFDIR --save CKPT                 a weights-only checkpoint to continue
              pretraining from (--load CKPT), under any expert-parallel size and
              ZeRO stage; the flags that build the model are printed at the end

Both convert one tensor at a time, so a model larger than memory converts; see
megatron/hf/ for the mappings.
"""

import argparse
import sys
from pathlib import Path

import torch

from megatron.config.parser import FlagParser, positive_int
from megatron.entry_point import run_entry_point
from megatron.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> FlagParser:
    parser = FlagParser(description=__doc__.split("\n\n")[0])
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--to", choices=["hf"], help="export a checkpoint of ours to Hugging Face")
    direction.add_argument("--from", dest="from_", choices=["hf"], help="import a Hugging Face model folder")
    parser.add_argument("--load", required=True, help="--to hf: our checkpoint directory; --from hf: the model folder")
    parser.add_argument("--save", required=True, help="the new folder to write")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="cast the floating-point weights (default: keep the dtype they are stored in)",
    )
    g = parser.add_argument_group("--to hf")
    g.add_argument("--ckpt-step", type=positive_int, default=None, help="the iteration to export; default the latest")
    g.add_argument(
        "--max-shard-size", default="5GB", help="largest weights file, as Hugging Face writes it (5GB, 500MB)"
    )
    g.add_argument("--tokenizer-model", default=None, help="the SentencePiece model, where it moved since training")
    g.add_argument("--vocab-file", default=None, help="GPT-2's vocab.json, where it moved since training")
    g.add_argument("--merge-file", default=None, help="GPT-2's merges.txt, where it moved since training")
    g = parser.add_argument_group("--from hf")
    g.add_argument(
        "--moe-expert-parallel-size",
        type=positive_int,
        default=1,
        help="the expert-parallel size you will train with, checked against the expert counts (the "
        "checkpoint itself loads under any)",
    )
    return parser


def log(line: str) -> None:
    print(line, flush=True)


def run(args: argparse.Namespace) -> Path:
    from megatron.hf.from_hf import import_from_hf
    from megatron.hf.safetensors_io import parse_size
    from megatron.hf.to_hf import export_to_hf

    dtype = DTYPES[args.dtype] if args.dtype else None
    if args.to:
        if args.moe_expert_parallel_size != 1:
            raise ConfigError(
                "--moe-expert-parallel-size applies to --from hf (an exported model holds all experts); drop it"
            )
        overrides = {
            "tokenizer_model": args.tokenizer_model,
            "vocab_file": args.vocab_file,
            "merge_file": args.merge_file,
        }
        return export_to_hf(
            args.load, args.save, args.ckpt_step, parse_size(args.max_shard_size), dtype, overrides, log
        )
    given = [
        flag
        for flag, value in (
            ("--ckpt-step", args.ckpt_step),
            ("--tokenizer-model", args.tokenizer_model),
            ("--vocab-file", args.vocab_file),
            ("--merge-file", args.merge_file),
        )
        if value is not None
    ] + (["--max-shard-size"] if args.max_shard_size != "5GB" else [])
    if given:
        raise ConfigError(f"{given[0]} applies to --to hf; drop it when importing with --from hf")
    return import_from_hf(args.load, args.save, args.moe_expert_parallel_size, dtype, log).folder


def main(argv: list[str] | None = None) -> Path:
    return run_entry_point(lambda: run(build_parser().parse_args(sys.argv[1:] if argv is None else argv)))
