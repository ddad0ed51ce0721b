"""Curriculum learning by sequence length under pipeline parallelism: at PP=2 the stages exchange
the iteration's shorter sequences, and training equals one process (losses to 1e-5 relative,
every stage's parameters), with the legacy curriculum_learning block and with data_efficiency's
curriculum sampling (vocabulary rarity and seqlen_truncate)."""

import json
from pathlib import Path

import pytest
import torch

from megatron.cli.analyze_data import analyze
from megatron.config.flags import parse_args
from megatron.parallel import build_parallel_grid, single_process_grid
from megatron.training.loop import Trainer
from tests.dist_utils import run_distributed
from tests.test_curriculum import BLOCK
from tests.test_curriculum_sampling import TRAIN, _sampling_config
from tests.training_fixtures import tiny_flags, write_corpus


def _trained(corpus: str, ds: str, pp: int, flag: str) -> dict[str, torch.Tensor]:
    # no biases: the key bias's gradient is round-off (softmax ignores it), which Adam's normalised
    # steps turn into differences between any two summation orders without changing the model
    flags = tiny_flags(corpus, **TRAIN, num_layers=4, pipeline_model_parallel_size=pp, disable_bias_linear=True)
    config = parse_args(flags + [flag, "--deepspeed", "--deepspeed_config", ds])
    grid = build_parallel_grid(torch.device("cpu"), pp_size=pp) if pp > 1 else single_process_grid(torch.device("cpu"))
    trainer = Trainer(config, grid)
    result = trainer.train()
    named = dict(trainer.engine.module.named_parameters())
    return {"losses": torch.tensor(result.losses), **{name: p.detach().clone() for name, p in named.items()}}


def _both(corpus: str, legacy: str, sampling: str, pp: int) -> dict[str, torch.Tensor]:
    legacy_run = _trained(corpus, legacy, pp, "--curriculum-learning-legacy")
    sampled_run = _trained(corpus, sampling, pp, "--data-efficiency-curriculum-learning")
    return {**{f"legacy/{k}": v for k, v in legacy_run.items()}, **{f"sampled/{k}": v for k, v in sampled_run.items()}}


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> tuple[str, str, str]:
    folder = tmp_path_factory.mktemp("curriculum_pp")
    corpus = write_corpus(folder)
    analyze(["vocab_rarity"], tiny_flags(corpus, **TRAIN, num_layers=4) + ["--save", str(folder / "analysis")])
    legacy = folder / "legacy.json"
    legacy.write_text(json.dumps({"curriculum_learning": BLOCK}))
    return corpus, str(legacy), _sampling_config(folder, Path(folder / "analysis"))


def test_two_pipeline_stages_train_the_curriculum_as_one_process(configs):
    serial = _both(*configs, 1)
    stages = run_distributed(_both, 2, *configs, 2)
    for kind in ("legacy", "sampled"):
        for stage in stages:
            torch.testing.assert_close(stage[f"{kind}/losses"], serial[f"{kind}/losses"], rtol=1e-5, atol=0)
        held = {name for stage in stages for name in stage if name.startswith(kind) and name != f"{kind}/losses"}
        assert len(held) == len([n for n in serial if n.startswith(kind)]) - 1
        for stage in stages:
            for name, value in stage.items():
                if name.startswith(kind) and name != f"{kind}/losses":
                    torch.testing.assert_close(value, serial[name], rtol=1e-5, atol=2e-6, msg=name)
