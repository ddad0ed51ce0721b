"""Blending several data sets into one by weight, with Megatron's greedy, deterministic order."""

import numpy as np
import torch

from megatron.errors import ConfigError, DataError


def parse_weighted_prefixes(items: list[str]) -> tuple[list[str], list[float]]:
    """[w1, p1, w2, p2, ...] -> ([p1, p2, ...], weights normalised to sum 1), as Megatron's --data-path."""
    if len(items) % 2 != 0:
        raise ConfigError(
            f"weighted data paths must come in pairs 'WEIGHT PREFIX', got {len(items)} items: {' '.join(items)}."
        )
    prefixes = [p.strip() for p in items[1::2]]
    weights = []
    for text in items[0::2]:
        try:
            weights.append(float(text))
        except ValueError as e:
            raise ConfigError(
                f"data path weight {text!r} is not a number; write the list as 'WEIGHT PREFIX WEIGHT PREFIX ...'."
            ) from e
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"data path weights {weights} must be non-negative with a positive sum.")
    total = sum(weights)
    return prefixes, [w / total for w in weights]


def data_prefixes(items: list[str]) -> list[str]:
    """The data set prefixes of a Megatron prefix list, [p] or [w1, p1, w2, p2, ...] (or none)."""
    return items if len(items) <= 1 else parse_weighted_prefixes(items)[0]


def build_blending_indices(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """For each of `size` samples, the data set furthest behind its share, and that set's next sample.

    Sample i goes to argmax_d(weights[d] * max(i, 1) - taken[d]) (first on ties). The loop runs
    on Python floats, which are the same doubles Megatron's C++ helper uses, so the order matches.
    """
    shares = [float(w) for w in weights]
    taken = [0] * len(shares)
    dataset_index = np.empty(size, dtype=np.int32)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    for i in range(size):
        scale = float(max(i, 1))
        best, best_error = 0, shares[0] * scale - taken[0]
        for d in range(1, len(shares)):
            error = shares[d] * scale - taken[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[i] = best
        dataset_sample_index[i] = taken[best]
        taken[best] += 1
    return dataset_index, dataset_sample_index


class BlendedDataset(torch.utils.data.Dataset):
    def __init__(self, datasets: list, weights: list[float], size: int) -> None:
        if len(datasets) != len(weights):
            raise ConfigError(
                f"blending needs one weight per data set, got {len(weights)} weights for {len(datasets)} data sets."
            )
        weights_array = np.asarray(weights, dtype=np.float64)
        weights_array /= np.sum(weights_array)
        self.datasets = datasets
        self.dataset_index, self.dataset_sample_index = build_blending_indices(weights_array, size)
        needed = np.bincount(self.dataset_index, minlength=len(datasets))
        for d, (dataset, count) in enumerate(zip(datasets, needed)):
            if count > len(dataset):
                raise DataError(
                    f"blending draws {count} samples from data set {d} of the blend, which has only {len(dataset)}; "
                    "lower its weight or the number of samples."
                )

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return self.datasets[self.dataset_index[i]][self.dataset_sample_index[i]]
