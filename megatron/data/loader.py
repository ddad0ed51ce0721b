"""Pretraining data loader with Megatron's sequential sampler: resumable at any consumed sample."""

from collections.abc import Iterator

import numpy as np
import torch

from megatron.errors import ConfigError, DataError


class PretrainingSampler(torch.utils.data.Sampler):
    """Yields this rank's micro-batch of sample indices, walking the dataset in order.

    Each global micro-step takes the next micro_batch_size * dp_size indices and rank r keeps
    [r * mbs, (r + 1) * mbs), so the stream depends only on consumed_samples: a resumed run
    sees exactly the batches an uninterrupted one would. An incomplete last step is dropped.
    """

    def __init__(
        self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int
    ) -> None:
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ConfigError(
                "data loader needs micro_batch_size >= 1 and 0 <= dp_rank < dp_size, "
                f"got {micro_batch_size}, {dp_rank} and {dp_size}."
            )
        if not 0 <= consumed_samples < total_samples:
            raise DataError(
                f"cannot resume at consumed sample {consumed_samples}: the dataset has {total_samples} samples; "
                "raise the number of training samples or start from an earlier checkpoint."
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.global_step_size = micro_batch_size * dp_size
        self.rank_start = dp_rank * micro_batch_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.global_step_size

    def __iter__(self) -> Iterator[list[int]]:
        for step_start in range(
            self.consumed_samples, self.total_samples - self.global_step_size + 1, self.global_step_size
        ):
            first = step_start + self.rank_start
            yield list(range(first, first + self.micro_batch_size))


def collate_text(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    return {"text": torch.from_numpy(np.stack([s["text"] for s in samples]).astype(np.int64))}


def build_pretraining_loader(
    dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int, num_workers: int = 0
) -> torch.utils.data.DataLoader:
    """DataLoader giving {"text": LongTensor [micro_batch_size, seq_length + 1]} for this DP rank."""
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate_text,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        # its own generator: making an iterator must not draw from the global RNG, or a resumed
        # run's dropout would differ from an uninterrupted one
        generator=torch.Generator(),
    )
