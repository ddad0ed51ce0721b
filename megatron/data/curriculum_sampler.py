"""DeepSpeed's curriculum data sampling (data_efficiency.data_sampling.curriculum_learning), as its
DeepSpeedDataSampler draws: the training samples are split into clusters of growing difficulty as
the schedules move, and each global batch draws from every cluster so far in proportion to its size.

- A metric's offline index (tools/analyze_data.py, or DeepSpeed's DataAnalyzer: the same files)
  lists the samples of each metric value in ascending order. `value` difficulty takes the samples
  with a value in (previous, current]; `percentile` takes positions [N/max x previous,
  N/max x current) of the samples in that order (to N at max_difficulty).
- When a step's difficulty changes, a new cluster is made: with one schedule-based metric, the
  samples between the previous and the current difficulty (every sample at the first step when
  there is none); with several, the samples within every metric's current difficulty less those
  already in a cluster. An empty one is skipped.
- Each global batch draws, for each of its samples, a cluster with probability proportional to
  the clusters' sizes, takes the next samples of each cluster's shuffled order (reshuffled when it
  runs out), and shuffles the batch; micro-batch m of rank r is its slice
  [(m x dp + r) x mbs, +mbs).

Unlike DeepSpeed's sampler, which keeps one random stream and writes every cluster to
data_cluster_path, every draw here comes from a generator seeded by (seed, step) or (seed, cluster,
pass), and the clusters stay in memory (8 bytes a sample): the batches depend only on the step, so
a resumed run (at any data-parallel size) replays the positions of the steps before it and draws
exactly what the uninterrupted run drew."""

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.errors import DataError


@dataclass(frozen=True)
class MetricIndex:
    """One metric's samples by ascending value: `samples[starts[k]:starts[k + 1]]` have the value
    `values[k]` (None for a percentile-merged index, whose rows are only an ordering)."""

    samples: np.ndarray
    starts: np.ndarray
    values: np.ndarray | None

    @classmethod
    def load(cls, sample_path: str, metric_path: str | None) -> "MetricIndex":
        rows = MMapIndexedDataset(sample_path)
        samples = np.concatenate([np.asarray(rows[k], dtype=np.int64) for k in range(len(rows))])
        starts = np.concatenate([[0], np.cumsum(rows.sizes, dtype=np.int64)])
        values = None
        if metric_path is not None:
            metric = MMapIndexedDataset(metric_path)
            if len(metric) != len(rows) or np.any(metric.sizes != 1):
                raise DataError(
                    f"{metric_path} holds {len(metric)} rows for the {len(rows)} rows of {sample_path}, not one value "
                    "a row; write both with the same tools/analyze_data.py run"
                )
            values = np.concatenate([np.asarray(metric[k], dtype=np.int64) for k in range(len(metric))])
        return cls(samples, starts, values)

    def by_value(self, above: float, at_most: int) -> np.ndarray:
        assert self.values is not None
        rows = (self.values > above) & (self.values <= at_most)
        return np.concatenate([self.samples[self.starts[k] : self.starts[k + 1]] for k in np.flatnonzero(rows)] or [[]])

    def by_percentile(self, start: int, end: int, max_percentile: int) -> np.ndarray:
        per = len(self.samples) // max_percentile
        return self.samples[per * start : len(self.samples) if end == max_percentile else per * end]


@dataclass(frozen=True)
class SampledMetric:
    """A schedule-based metric: its difficulty at each step (from 1), its difficulty type and its
    index. `max_difficulty`: the number of percentiles, for `by_percentile`."""

    name: str
    difficulty: Callable[[int], int]
    by_percentile: bool
    max_difficulty: int
    index: MetricIndex

    @property
    def lowest(self) -> float:
        """The difficulty below every sample's: DeepSpeed's previous difficulty at the first step."""
        return 0 if self.by_percentile else float("-inf")

    def within(self, above: float, at_most: int) -> np.ndarray:
        if self.by_percentile:
            return self.index.by_percentile(int(above), at_most, self.max_difficulty)
        return self.index.by_value(above, at_most)


@dataclass
class _Cluster:
    members: np.ndarray
    position: int = 0  # into the current pass's order
    passes: int = 0
    order: np.ndarray | None = field(default=None, repr=False)  # the current pass's, made when first drawn


class CurriculumSampler(torch.utils.data.Sampler):
    """Yields this rank's micro-batches of sample indices, step after step from `consumed_steps`."""

    def __init__(
        self,
        metrics: list[SampledMetric],
        num_samples: int,
        seed: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        consumed_steps: int,
    ) -> None:
        self.metrics, self.num_samples, self.seed = metrics, num_samples, seed
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size, self.consumed_steps = dp_rank, dp_size, consumed_steps
        for metric in metrics:
            if len(metric.index.samples) != num_samples or (
                num_samples and int(metric.index.samples.max()) >= num_samples
            ):
                raise DataError(
                    f"curriculum metric {metric.name}'s index lists {len(metric.index.samples)} samples but the "
                    f"training split has {num_samples}; run tools/analyze_data.py with this run's data flags "
                    "(--data-path, --split, --seq-length, --seed, --train-iters, --global-batch-size)"
                )
        self.clusters: list[_Cluster] = []
        self.difficulties: dict[str, int] = {}

    def _update_clusters(self, step: int) -> None:
        """DeepSpeed's get_new_cluster when a difficulty changes at `step`."""
        current = {m.name: m.difficulty(step) for m in self.metrics}
        if self.clusters and current == self.difficulties:
            return
        previous = {m.name: self.difficulties.get(m.name, m.lowest) for m in self.metrics}
        self.difficulties = current
        if len(self.metrics) > 1:
            members = self.metrics[0].within(self.metrics[0].lowest, current[self.metrics[0].name])
            for m in self.metrics[1:]:
                members = np.intersect1d(members, m.within(m.lowest, current[m.name]))
            for cluster in self.clusters:
                members = np.setdiff1d(members, cluster.members)
        elif self.metrics:
            m = self.metrics[0]
            members = m.within(previous[m.name], current[m.name])
        else:  # sequence length alone: every sample is in the one cluster
            members = np.arange(self.num_samples, dtype=np.int64) if not self.clusters else np.empty(0, np.int64)
        if len(members):
            self.clusters.append(_Cluster(np.asarray(members, dtype=np.int64)))

    def _counts(self, step: int) -> tuple[np.random.Generator, np.ndarray]:
        """The step's generator and how many of its samples each cluster gives."""
        rng = np.random.default_rng([self.seed, step])
        sizes = np.array([len(c.members) for c in self.clusters], dtype=np.float64)
        chosen = rng.choice(len(self.clusters), self.global_batch_size, replace=True, p=sizes / sizes.sum())
        return rng, np.bincount(chosen, minlength=len(self.clusters))

    def _take(self, index: int, count: int, draw: bool) -> list[np.ndarray]:
        """The next `count` samples of cluster `index`'s order (only its position moves unless `draw`)."""
        cluster, taken = self.clusters[index], []
        while count:
            size = len(cluster.members)
            part = min(count, size - cluster.position)
            if draw:
                if cluster.order is None:
                    rng = np.random.default_rng([self.seed, index, cluster.passes])
                    cluster.order = cluster.members[rng.permutation(size)]
                taken.append(cluster.order[cluster.position : cluster.position + part])
            cluster.position += part
            count -= part
            if cluster.position == size:
                cluster.position, cluster.passes, cluster.order = 0, cluster.passes + 1, None
        return taken

    def global_batch(self, step: int, draw: bool = True) -> np.ndarray:
        """Step `step`'s (from 1) samples in the order the micro-batches take them."""
        self._update_clusters(step)
        if not self.clusters:
            raise DataError(
                f"no training sample is within the curriculum's difficulties {self.difficulties} at step {step}; "
                "raise the metrics' min_difficulty"
            )
        rng, counts = self._counts(step)
        parts = [part for index, count in enumerate(counts) for part in self._take(index, int(count), draw)]
        if not draw:
            return np.empty(0, np.int64)
        batch = np.concatenate(parts)
        rng.shuffle(batch)
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        self.clusters, self.difficulties = [], {}  # each iterator replays from the first step
        for step in range(1, self.consumed_steps + 1):  # the clusters' positions where the run stopped
            self.global_batch(step, draw=False)
        step = self.consumed_steps
        per_micro_step = self.micro_batch_size * self.dp_size
        while True:
            step += 1
            batch = self.global_batch(step)
            for start in range(0, self.global_batch_size, per_micro_step):
                first = start + self.dp_rank * self.micro_batch_size
                yield batch[first : first + self.micro_batch_size].tolist()
