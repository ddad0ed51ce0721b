"""The training, validation and test datasets of a run, as pretrain_gpt.py builds them from its
flags: the trainer reads them, and tools/analyze_data.py indexes the same training samples."""

from typing import Any

from megatron.config.flags import PretrainConfig
from megatron.data.gpt_dataset import build_train_valid_test_datasets
from megatron.errors import DataError
from megatron.training.run_length import run_length


def run_datasets(config: PretrainConfig, vocab_size: int, train_iters: int | None = None) -> tuple[Any, Any, Any]:
    """The (train, valid, test) datasets of the run's flags (a split may be None); the first call
    builds and caches their index arrays, later calls load them."""
    t, d = config.training, config.data
    eval_samples = config.logging.eval_iters * t.global_batch_size
    datasets = build_train_valid_test_datasets(
        list(d.data_path) if d.data_path else None,
        d.split,
        ((train_iters or run_length(config).train_iters) * t.global_batch_size, eval_samples, eval_samples),
        t.seq_length,
        t.seed,
        train_data_prefix=list(d.train_data_path) if d.train_data_path else None,
        valid_data_prefix=list(d.valid_data_path) if d.valid_data_path else None,
        test_data_prefix=list(d.test_data_path) if d.test_data_path else None,
        vocab_size=vocab_size,  # every sample's ids are checked as it is read
        split_rounding=d.split_rounding,
        verify_checksum=d.data_checksum,
    )
    if datasets[0] is None:
        raise DataError("the training split is empty; give more data or a --split with a non-zero first part")
    return datasets
