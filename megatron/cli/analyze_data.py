"""`tools/analyze_data.py`: the offline data analysis behind curriculum sampling, as
Megatron-DeepSpeed's examples_deepspeed/data_efficiency/analyze_data.py runs DeepSpeed's
DataAnalyzer for GPT data, with the files in its layout (so its configs and ours read either):

    SAVE/total_vocab_freq/total_vocab_freq_metric_value      one row: each token id's count
    SAVE/vocab_rarity/vocab_rarity_sample_to_metric          one row: each sample's rarity
    SAVE/vocab_rarity/vocab_rarity_index_to_metric           row k: the k-th smallest rarity
    SAVE/vocab_rarity/vocab_rarity_index_to_sample           row k: the samples with that rarity
    SAVE/vocab_rarity/vocab_rarity_index_to_sample_percentile_merged
                                                             the same order in rows of >= 1% of them

A sample's vocabulary rarity is Megatron-DeepSpeed's: the sum over its seq-length + 1 tokens of
-log(count / total count) of each token (a count of 0 taken as 1), truncated to an integer. The
samples are those of the training split that pretrain_gpt.py builds from the same flags (data,
split, sequence length, seed, iterations and batch size): sample i of the index is the i-th sample
the trainer's curriculum sampler can draw. One process does the map and the reduce that
DeepSpeed splits over workers and threads."""

import math
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from megatron.config.flags import parse_args
from megatron.config.parser import FlagParser
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, bin_path, idx_path
from megatron.data.tokenizer import tokenizer_of
from megatron.entry_point import run_entry_point
from megatron.errors import ConfigError
from megatron.tokenizer_spec import tokenizer_spec_of
from megatron.training.run_datasets import run_datasets

METRICS = ("total_vocab_freq", "vocab_rarity")


def build_parser() -> FlagParser:
    parser = FlagParser(
        prog="tools/analyze_data.py",
        description="Index the training samples of pretrain_gpt.py's flags by a difficulty metric for curriculum "
        "sampling (ds_config data_efficiency.data_sampling.curriculum_learning); every other flag is "
        "pretrain_gpt.py's, --save the folder the index goes to.",
    )
    parser.add_argument("--analyzing-metric", nargs="+", choices=METRICS, default=["vocab_rarity"])
    return parser


def smallest_int_dtype(largest: int) -> np.dtype:
    """The smallest index dtype holding 0..largest, as DeepSpeed's find_fit_int_dtype picks one."""
    return next(np.dtype(t) for t in (np.uint8, np.uint16, np.int32, np.int64) if largest <= np.iinfo(t).max)


def write_rows(prefix: Path, rows: list[np.ndarray], dtype: np.dtype) -> None:
    """Rows of integers as a Megatron/DeepSpeed indexed dataset PREFIX.bin / PREFIX.idx."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with MMapIndexedDatasetBuilder(bin_path(str(prefix)), dtype) as builder:
        for row in rows:
            builder.add_item(row)
        builder.end_document()
        builder.finalize(idx_path(str(prefix)))


def vocabulary_counts(dataset, vocab_size: int) -> np.ndarray:
    counts = np.zeros(vocab_size, dtype=np.int64)
    for index in tqdm(range(len(dataset)), desc="analysis: counting tokens", unit="sample"):
        counts += np.bincount(dataset[index]["text"], minlength=vocab_size)
    return counts


def rarities(dataset, counts: np.ndarray) -> np.ndarray:
    rarity_of_token = -np.log(np.maximum(counts, 1) / counts.sum())
    values = np.empty(len(dataset), dtype=np.int64)
    for index in tqdm(range(len(dataset)), desc="analysis: vocabulary rarity", unit="sample"):
        values[index] = int(rarity_of_token[dataset[index]["text"]].sum())
    return values


def write_index(folder: Path, name: str, values: np.ndarray) -> None:
    """The sample-to-metric row, and the samples grouped by ascending value (whole and merged)."""
    order = np.argsort(values, kind="stable")
    distinct, starts = np.unique(values[order], return_index=True)
    bounds = list(starts) + [len(order)]
    groups = [order[bounds[k] : bounds[k + 1]] for k in range(len(distinct))]
    sample_dtype = smallest_int_dtype(len(values))
    write_rows(folder / f"{name}_sample_to_metric", [values], np.dtype(np.int64))
    write_rows(folder / f"{name}_index_to_metric", [np.array([v]) for v in distinct], np.dtype(np.int64))
    write_rows(folder / f"{name}_index_to_sample", groups, sample_dtype)
    per_row = max(1, math.ceil(len(values) / 100))
    merged = [order[start : start + per_row] for start in range(0, len(order), per_row)]
    write_rows(folder / f"{name}_index_to_sample_percentile_merged", merged, sample_dtype)


def analyze(metrics: list[str], argv: list[str]) -> None:
    config = parse_args(argv)
    if config.checkpoint.save is None:
        raise ConfigError("tools/analyze_data.py writes its index under --save; give --save FOLDER")
    save = Path(config.checkpoint.save)
    tokenizer = tokenizer_of(tokenizer_spec_of(config.data))
    train, _, _ = run_datasets(config, tokenizer.vocab_size)
    counts = vocabulary_counts(train, tokenizer.vocab_size + 1)
    if "total_vocab_freq" in metrics:
        write_rows(save / "total_vocab_freq" / "total_vocab_freq_metric_value", [counts], np.dtype(np.int64))
    if "vocab_rarity" in metrics:
        values = rarities(train, counts)
        write_index(save / "vocab_rarity", "vocab_rarity", values)
        print(
            f" > vocab_rarity of {len(values)} training samples: min {values.min()}, max {values.max()}, "
            f"mean {values.mean():.1f}; index in {save / 'vocab_rarity'}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    def run() -> None:
        own, rest = build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
        analyze(own.analyzing_metric, rest)

    run_entry_point(run)
