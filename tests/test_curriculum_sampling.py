"""data_efficiency's curriculum sampling (data_sampling.curriculum_learning): tools/analyze_data.py
writes DeepSpeed's index files with the vocabulary rarity written out here from Megatron-DeepSpeed's
analyze_data.py; the sampler's clusters are DeepSpeed's get_sample_based_on_metric_percentile /
_value ranges (written out here from its source's description), every drawn sample lies within the
schedule's difficulty, a resumed or re-split sampler draws what the uninterrupted one drew, and the
trainer reads the sampler's samples cut to the seqlen_truncate schedule and resumes exactly."""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.checkpoint.layout import LATEST_FILE
from megatron.cli.analyze_data import analyze
from megatron.config.flags import parse_args
from megatron.data.curriculum_sampler import CurriculumSampler, MetricIndex, SampledMetric
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.errors import ConfigError, DataError
from megatron.parallel import single_process_grid
from megatron.training.loop import Trainer
from megatron.training.run_datasets import run_datasets
from megatron.training.step import forward_step
from tests.training_fixtures import VOCAB, tiny_flags, write_corpus

SINGLE = single_process_grid(torch.device("cpu"))
TRAIN = {"micro_batch_size": 2, "global_batch_size": 4, "train_iters": 12, "hidden_dropout": 0.0,
         "attention_dropout": 0.0}  # fmt: skip


def _rows(prefix) -> list[np.ndarray]:
    rows = MMapIndexedDataset(str(prefix))
    return [np.asarray(rows[k]) for k in range(len(rows))]


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory):
    """A corpus, its analysis under the run's flags, and the run's training split."""
    folder = tmp_path_factory.mktemp("analyzed")
    corpus = write_corpus(folder)
    flags = tiny_flags(corpus, **TRAIN)
    analyze(["total_vocab_freq", "vocab_rarity"], flags + ["--save", str(folder / "analysis")])
    train, _, _ = run_datasets(parse_args(flags), VOCAB + 1)
    return corpus, folder / "analysis", train


def test_the_analysis_is_megatron_deepspeeds_vocabulary_rarity_in_deepspeeds_files(analyzed):
    _, analysis, train = analyzed
    samples = [np.asarray(train[i]["text"]) for i in range(len(train))]
    counts = np.bincount(np.concatenate(samples), minlength=VOCAB + 2)
    (saved_counts,) = _rows(analysis / "total_vocab_freq" / "total_vocab_freq_metric_value")
    assert np.array_equal(saved_counts, counts)
    # -log(frequency) of each token, a count of 0 taken as 1, summed over the sample and truncated
    rarity = [int(sum(-math.log(max(counts[t], 1) / counts.sum()) for t in sample)) for sample in samples]
    folder = analysis / "vocab_rarity"
    (per_sample,) = _rows(folder / "vocab_rarity_sample_to_metric")
    assert per_sample.tolist() == rarity
    values = [int(row[0]) for row in _rows(folder / "vocab_rarity_index_to_metric")]
    assert values == sorted(set(rarity))
    groups = _rows(folder / "vocab_rarity_index_to_sample")
    assert [sorted(group.tolist()) for group in groups] == [
        [i for i, r in enumerate(rarity) if r == value] for value in values
    ]
    merged = _rows(folder / "vocab_rarity_index_to_sample_percentile_merged")
    assert np.array_equal(np.concatenate(merged), np.concatenate(groups))
    assert all(len(row) >= math.ceil(len(train) / 100) for row in merged[:-1])


def deepspeed_percentile_cluster(order: list[int], start: int, end: int, max_percentile: int) -> list[int]:
    """DeepSpeed's get_sample_based_on_metric_percentile over the samples in metric order."""
    per = len(order) // max_percentile
    end_count = len(order) if end == max_percentile else per * end
    return order[per * start : end_count]


def _synthetic(n: int = 200, seed: int = 0) -> tuple[MetricIndex, np.ndarray]:
    """An index of `n` samples whose metric is a random value in 0..49."""
    values = np.random.default_rng(seed).integers(0, 50, size=n)
    order = np.argsort(values, kind="stable")
    distinct, starts = np.unique(values[order], return_index=True)
    return MetricIndex(order, np.append(starts, n), distinct), values


def _percentile_metric(index: MetricIndex) -> SampledMetric:
    # fixed_linear from 10 to 100 percentiles over 9 steps, in steps of 10
    return SampledMetric("vocabularyrarity", lambda step: min(100, 10 + 10 * (step - 1)), True, 100, index)


def test_each_step_draws_only_samples_within_its_percentile_and_every_cluster_is_deepspeeds():
    index, _ = _synthetic()
    sampler = CurriculumSampler([_percentile_metric(index)], 200, 1234, 16, 4, 0, 1, 0)
    order = index.samples.tolist()
    drawn: list[int] = []
    for step in range(1, 12):
        batch = sampler.global_batch(step)
        allowed = set(deepspeed_percentile_cluster(order, 0, min(100, 10 * step), 100))
        assert len(batch) == 16 and set(batch.tolist()) <= allowed, step
        drawn += batch.tolist()
    clusters = [sorted(c.members.tolist()) for c in sampler.clusters]
    expected = [sorted(deepspeed_percentile_cluster(order, 10 * k, 10 * (k + 1), 100)) for k in range(10)]
    assert clusters == expected
    # the easiest cluster, drawn alone at step 1, is drawn without repeats until it runs out (20 samples)
    assert len(set(drawn[:16])) == 16


def test_value_difficulty_takes_the_samples_between_two_values():
    index, values = _synthetic()
    metric = SampledMetric("rarity", lambda step: [9, 9, 29, 49][min(step, 4) - 1], False, 49, index)
    sampler = CurriculumSampler([metric], 200, 7, 8, 8, 0, 1, 0)
    for step in range(1, 5):
        sampler.global_batch(step)
    clusters = [sorted(c.members.tolist()) for c in sampler.clusters]
    ranges = [(-math.inf, 9), (9, 29), (29, 49)]
    assert clusters == [sorted(np.flatnonzero((values > lo) & (values <= hi)).tolist()) for lo, hi in ranges]


def test_two_metrics_make_disjoint_clusters_within_both_difficulties():
    first, first_values = _synthetic(seed=0)
    second, second_values = _synthetic(seed=1)
    metrics = [
        SampledMetric("a", lambda step: min(49, 10 * step), False, 49, first),
        SampledMetric("b", lambda step: min(49, 20 * step), False, 49, second),
    ]
    sampler = CurriculumSampler(metrics, 200, 3, 8, 8, 0, 1, 0)
    seen: set[int] = set()
    for step in range(1, 7):
        sampler.global_batch(step)
        within = set(np.flatnonzero((first_values <= min(49, 10 * step)) & (second_values <= min(49, 20 * step))))
        members = set().union(*(set(c.members.tolist()) for c in sampler.clusters))
        assert members == within and sum(len(c.members) for c in sampler.clusters) == len(members), step
        seen |= members
    assert seen == set(range(200))


def _micro_batches(sampler: CurriculumSampler, count: int) -> list[list[int]]:
    stream = iter(sampler)
    return [next(stream) for _ in range(count)]


def test_a_resumed_or_re_split_sampler_draws_what_the_uninterrupted_one_drew():
    index, _ = _synthetic()
    metric = _percentile_metric(index)
    # global batch 16 = micro-batch 4 x 2 ranks x 2 accumulation steps; 10 steps = 20 micro-batches a rank
    ranks = [_micro_batches(CurriculumSampler([metric], 200, 5, 16, 4, rank, 2, 0), 20) for rank in range(2)]
    resumed = [_micro_batches(CurriculumSampler([metric], 200, 5, 16, 4, rank, 2, 6), 8) for rank in range(2)]
    assert resumed == [stream[12:] for stream in ranks]  # steps 7-10
    again = CurriculumSampler([metric], 200, 5, 16, 4, 0, 2, 6)
    assert _micro_batches(again, 8) == _micro_batches(again, 8) == resumed[0]  # a second iterator starts over
    one_rank = _micro_batches(CurriculumSampler([metric], 200, 5, 16, 8, 0, 1, 0), 20)
    for step in range(10):  # each micro-step's 8 samples: rank 0's 4 then rank 1's
        for micro in range(2):
            together = one_rank[2 * step + micro]
            assert together == ranks[0][2 * step + micro] + ranks[1][2 * step + micro]


def _sampling_config(tmp_path, analysis, **metric_overrides) -> str:
    rarity = {
        "index_to_sample_path": str(analysis / "vocab_rarity" / "vocab_rarity_index_to_sample_percentile_merged"),
        "index_to_metric_path": str(analysis / "vocab_rarity" / "vocab_rarity_index_to_metric"),
        "difficulty_type": "percentile",
        "clustering_type": "schedule_based",
        "min_difficulty": 25,
        "max_difficulty": 100,
        "schedule_type": "fixed_root",
        "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 5, "root_degree": 2},
        **metric_overrides,
    }
    seqlen = {
        "index_to_sample_path": "dummy",
        "index_to_metric_path": "dummy",
        "difficulty_type": "value",
        "clustering_type": "single_cluster",
        "min_difficulty": 8,
        "max_difficulty": 16,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 6, "difficulty_step": 4},
    }
    block = {
        "enabled": True,
        "seed": 1234,
        "data_sampling": {
            "enabled": True,
            "num_epochs": 1,
            "num_workers": 0,
            "curriculum_learning": {
                "enabled": True,
                "data_cluster_path": str(tmp_path / "clusters"),
                "curriculum_metrics": {"vocabularyrarity": rarity, "seqlen_truncate": seqlen},
            },
        },
    }
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"data_efficiency": block}))
    return str(ds)


def _run_flags(corpus: str, ds: str, **overrides) -> list[str]:
    flags = tiny_flags(corpus, **{**TRAIN, **overrides})
    return flags + ["--data-efficiency-curriculum-learning", "--deepspeed", "--deepspeed_config", ds]


def test_a_run_reads_the_samplers_samples_cut_to_the_schedule_and_resumes_exactly(tmp_path, analyzed):
    corpus, analysis, train = analyzed
    ds = _sampling_config(tmp_path, analysis)
    seen: list[torch.Tensor] = []

    def recording(engine, batch, *args, **kwargs):
        if engine.module.training:
            seen.append(batch.tokens_BS.clone())
        return forward_step(engine, batch, *args, **kwargs)

    full_dir = tmp_path / "full"
    trainer = Trainer(
        parse_args(_run_flags(corpus, ds, save=str(full_dir), save_interval=6)), SINGLE, forward=recording
    )
    result = trainer.train()
    # what the trainer's own sampler draws, read from the split and cut to fixed_linear 8 -> 16 in steps of 4
    sampler = trainer.curriculum_sampling.sampler(len(train), trainer.config, 0, 1, 0)
    lengths = [min(16, math.floor(i / 6 * 8 + 8) // 4 * 4) for i in range(1, 13)]
    expected = []
    for step in range(1, 13):
        batch = sampler.global_batch(step)
        for micro in range(2):
            rows = [np.asarray(train[int(i)]["text"])[: lengths[step - 1]] for i in batch[2 * micro : 2 * micro + 2]]
            expected.append(torch.from_numpy(np.stack(rows).astype(np.int64)))
    assert len(seen) == 24 and all(torch.equal(a, b) for a, b in zip(seen, expected))
    assert trainer.consumed_tokens == 4 * sum(lengths)
    # resumed at iteration 6: the same samples, losses and weights
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(full_dir / "iter_0000006", resumed_dir / "iter_0000006")
    (resumed_dir / LATEST_FILE).write_text("6\n")
    seen.clear()
    flags = _run_flags(corpus, ds, load=str(resumed_dir), save=str(resumed_dir))
    resumed = Trainer(parse_args(flags), SINGLE, forward=recording)
    assert resumed.train().losses == result.losses[6:]
    assert all(torch.equal(a, b) for a, b in zip(seen, expected[12:]))
    for a, b in zip(trainer.engine.module.parameters(), resumed.engine.module.parameters()):
        assert torch.equal(a, b)


def test_what_the_sampling_cannot_take_is_refused_by_name(tmp_path, analyzed):
    corpus, analysis, _ = analyzed
    ds = _sampling_config(tmp_path, analysis)
    with pytest.raises(DataError, match=r"index lists \d+ samples but the training split has \d+; run tools/analy"):
        Trainer(parse_args(_run_flags(corpus, ds, train_iters=400)), SINGLE).train()  # two epochs' samples
    plain = tmp_path / "plain.json"
    plain.write_text("{}")
    with pytest.raises(ConfigError, match="--data-efficiency-curriculum-learning needs the ds_config data_efficiency"):
        Trainer(parse_args(_run_flags(corpus, str(plain))), SINGLE)
    both = json.loads(Path(ds).read_text())
    both["curriculum_learning"] = {"enabled": True, "min_difficulty": 8, "max_difficulty": 16,
                                   "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 8}}  # fmt: skip
    plain.write_text(json.dumps(both))
    with pytest.raises(ConfigError, match="the legacy curriculum_learning block and data_efficiency's curriculum"):
        Trainer(parse_args(_run_flags(corpus, str(plain))), SINGLE)
