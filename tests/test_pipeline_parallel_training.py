"""Training under pipeline parallelism (1F1B) equals training on one process: 10 iterations of the
Trainer at PP=2 (tied and untied embeddings, dense and MoE, ZeRO 0 and 1, an uneven split), at
TP=2 x PP=2 and PP=2 x EP=2 (ZeRO 1 and 3), PP=2 x DP=2 (ZeRO 1, 2 and 3) and PP=2 x DP=2 x expert-TP=2
(ZeRO 3), losses to 1e-5 relative and every stage's parameters after
the steps; checkpoints move between PP=2 and one process."""

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from megatron.errors import ConfigError
from megatron.parallel import build_parallel_grid, single_process_grid
from megatron.training.loop import Trainer
from tests.dist_utils import Results, layout_spawns, run_distributed
from tests.test_tensor_parallel_training import ARCHITECTURES, _train, assert_same, offload, write_offload_configs
from tests.training_fixtures import tiny_config, write_corpus

FOUR_LAYERS = {"num_layers": 4}


def _runs(world: int, folder: str) -> list[tuple[str, str, dict[str, object]]]:
    """(key, serial reference, flags) of each run on `world` ranks."""
    if world == 2:
        return [
            ("classic/zero0", "classic", {"zero_stage": 0}),
            ("classic/zero1", "classic", {"zero_stage": 1}),
            ("modern/zero1", "modern", {**ARCHITECTURES["modern"], "zero_stage": 1}),
            ("moe/zero0", "moe", {**ARCHITECTURES["moe"], "zero_stage": 0}),
            ("modern_moe/zero1", "modern_moe", {**ARCHITECTURES["modern_moe"], "zero_stage": 1}),
            ("uneven/zero1", "uneven", {**FOUR_LAYERS, "decoder_first_pipeline_num_layers": 1, "zero_stage": 1}),
            ("offload/zero1", "classic", offload(folder, "cpu")),
        ]
    return [
        *(
            (
                f"tp2/zero{stage}",
                "modern",
                {
                    **ARCHITECTURES["modern"],
                    "tensor_model_parallel_size": 2,
                    "sequence_parallel": True,
                    "zero_stage": stage,
                },
            )
            for stage in (1, 3)
        ),
        ("dp2/zero1", "classic", {"zero_stage": 1}),
        # stages 2 and 3 reduce during backward: with untied embeddings only (nothing to sum between stages)
        ("dp2/zero2", "modern", {**ARCHITECTURES["modern"], "zero_stage": 2}),
        ("dp2/zero3", "modern", {**ARCHITECTURES["modern"], "zero_stage": 3}),
        ("ep2/zero1", "moe", {**ARCHITECTURES["moe"], "moe_expert_parallel_size": 2, "zero_stage": 1}),
        ("ep2/zero3", "modern_moe", {**ARCHITECTURES["modern_moe"], "moe_expert_parallel_size": 2, "zero_stage": 3}),
        ("tp2ep2/zero1", "moe", TP2_EP2),
        (
            "dp2etp2/zero3",
            "modern_moe",
            {**ARCHITECTURES["modern_moe"], "expert_tensor_parallel_size": 2, "zero_stage": 3},
        ),
    ]


TP2_EP2 = {
    **ARCHITECTURES["moe"],
    "tensor_model_parallel_size": 2,
    "sequence_parallel": True,
    "moe_expert_parallel_size": 2,
    "zero_stage": 1,
}


def _on_rank(corpus: str, folder: str, layouts: list[str], checkpoints: bool) -> dict[str, torch.Tensor]:
    """Each of `layouts` (keys of _runs) trained under PP=2; with `checkpoints`, the checkpoints moved
    between this world's layout and one process's."""
    world = dist.get_world_size()
    out = {}
    for key, _, flags in _runs(world, folder):
        if key not in layouts:
            continue
        tp = int(flags.get("tensor_model_parallel_size", 1))
        grid = build_parallel_grid(
            torch.device("cpu"),
            tp_size=tp,
            pp_size=2,
            ep_size=int(flags.get("moe_expert_parallel_size", 1)),
            expert_tp_size=int(flags.get("expert_tensor_parallel_size", 1)),
        )
        result = _train(corpus, grid.dp_size, grid, pipeline_model_parallel_size=2, **flags)
        out.update({f"{key}/{name}": value for name, value in result.items()})
    if world == 2:  # tied embeddings need their gradients summed over the stages before stage 2 reduces them
        grid = build_parallel_grid(torch.device("cpu"), pp_size=2)
        with pytest.raises(ConfigError, match="ZeRO stage 2 reduces gradients during backward, before the tied word"):
            _train(corpus, 1, grid, pipeline_model_parallel_size=2, zero_stage=2)
    if not checkpoints:
        return out
    # checkpoints: this layout's for one process, and one process's resumed here
    if world == 2:
        grid = build_parallel_grid(torch.device("cpu"), pp_size=2)
        _train(corpus, 1, grid, pipeline_model_parallel_size=2, zero_stage=1, save=f"{folder}/pp2", save_interval=5)
        result = _train(
            corpus, 1, grid, pipeline_model_parallel_size=2, zero_stage=0, load=f"{folder}/serial", ckpt_step=5
        )
    else:  # TP=2 x PP=2 x EP=2
        grid = build_parallel_grid(torch.device("cpu"), tp_size=2, pp_size=2, ep_size=2)
        _train(corpus, 1, grid, pipeline_model_parallel_size=2, save=f"{folder}/tp2pp2ep2", save_interval=5, **TP2_EP2)
        result = _train(
            corpus,
            1,
            grid,
            pipeline_model_parallel_size=2,
            load=f"{folder}/serial_moe",
            ckpt_step=5,
            **{**TP2_EP2, "zero_stage": 0},
        )
    out.update({f"resumed/{name}": value for name, value in result.items()})
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("pp_corpus"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("pp_checkpoints"))
    write_offload_configs(path)
    return path


@pytest.fixture(scope="module")
def serial(corpus, folder) -> dict[str, dict[str, torch.Tensor]]:
    grid = single_process_grid(torch.device("cpu"))
    runs = {arch: _train(corpus, 1, grid, **flags) for arch, flags in ARCHITECTURES.items()}
    runs["uneven"] = _train(corpus, 1, grid, **FOUR_LAYERS)
    assert_same(_train(corpus, 1, grid, save=f"{folder}/serial", save_interval=5), runs["classic"])
    assert_same(
        _train(corpus, 1, grid, save=f"{folder}/serial_moe", save_interval=5, **ARCHITECTURES["moe"]), runs["moe"]
    )
    return runs


def _stage_parameters(results: list[dict[str, torch.Tensor]], key: str) -> dict[str, list[torch.Tensor]]:
    """Each parameter name of run `key` with the values every rank that holds it has."""
    found: dict[str, list[torch.Tensor]] = {}
    for result in results:
        for name, value in result.items():
            if name.startswith(key + "/") and not name.endswith("/losses"):
                found.setdefault(name[len(key) + 1 :], []).append(value)
    return found


@pytest.fixture(scope="module")
def distributed(request, corpus, folder, serial) -> Callable[[int], Results]:
    """Every rank's results of one spawn per world size (after `serial`, whose checkpoints it resumes)."""
    return layout_spawns(request, _on_rank, corpus, folder)


LAYOUTS = [(world, key) for world in (2, 4) for key, _, _ in _runs(world, "")]


@pytest.mark.parametrize("world, layout", LAYOUTS, ids=[f"w{world}-{key}" for world, key in LAYOUTS])
def test_a_pipeline_parallel_layout_trains_as_one_process(distributed, serial, world: int, layout: str) -> None:
    results = distributed(world)
    reference = next(reference for key, reference, _ in _runs(world, "") if key == layout)
    want = serial[reference]
    # every rank reports the pipeline's loss of its data-parallel share; the shares average to the whole
    losses = torch.stack([result[f"{layout}/losses"] for result in results]).mean(0)
    assert len(losses) == 10
    torch.testing.assert_close(losses, want["losses"], rtol=1e-5, atol=0, msg=f"{layout}/losses")
    found = _stage_parameters(results, layout)
    assert set(found) == set(want) - {"losses"}, layout  # the stages hold every parameter between them
    for name, values in found.items():
        for value in values:
            torch.testing.assert_close(value, want[name], rtol=1e-5, atol=2e-6, msg=f"{layout}/{name}")


# per world size: the layout its checkpoint test moves checkpoints to and from, its folder, and the reference run
CHECKPOINT_LAYOUTS = {
    2: ("PP=2", "pp2", "classic", {}),
    4: ("TP=2 x PP=2 x EP=2", "tp2pp2ep2", "moe", ARCHITECTURES["moe"]),
}


@pytest.mark.parametrize("world", [2, 4])
def test_one_processs_checkpoint_resumes_under_pipeline_parallelism(distributed, serial, world: int) -> None:
    results = distributed(world)
    layout, _, reference, _ = CHECKPOINT_LAYOUTS[world]
    for name, values in _stage_parameters(results, "resumed").items():
        for value in values:
            torch.testing.assert_close(
                value, serial[reference][name], rtol=1e-5, atol=2e-6, msg=f"{layout} resumed from one process: {name}"
            )
    torch.testing.assert_close(results[0]["resumed/losses"], serial[reference]["losses"][5:], rtol=1e-5, atol=0)


@pytest.mark.parametrize("world", [2, 4])
def test_a_pipeline_parallel_checkpoint_resumes_on_one_process(distributed, serial, corpus, folder, world: int) -> None:
    distributed(world)  # saves it
    layout, saved, reference, flags = CHECKPOINT_LAYOUTS[world]
    grid = single_process_grid(torch.device("cpu"))
    assert_same(
        _train(corpus, 1, grid, zero_stage=3, load=f"{folder}/{saved}", ckpt_step=5, **flags),
        serial[reference],
        f"one process at stage 3 resumed from {layout}: ",
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            {"pipeline_model_parallel_size": 2, "num_layers": 3},
            "--num-layers 3 cannot be split over --pipeline-model-parallel-size 2",
        ),
        (
            {"pipeline_model_parallel_size": 2, "decoder_first_pipeline_num_layers": 2},
            "--num-layers 2 cannot be split over --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 2",
        ),
    ],
)
def test_layer_splits_that_do_not_fit_stop_with_one_sentence(corpus, flags, message) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_config(corpus, **flags)


def _moe_layers_reported(corpus: str) -> dict[str, torch.Tensor]:
    """The MoE log's layers after one step at PP=2 with MoE layers 2 (stage 0) and 4 (stage 1)."""
    grid = build_parallel_grid(torch.device("cpu"), pp_size=2)
    trainer = Trainer(
        tiny_config(
            corpus,
            num_layers=4,
            num_experts=[4],
            pipeline_model_parallel_size=2,
            lr_warmup_iters=0,
            disable_moe_token_dropping=True,
        ),
        grid,
    )
    trainer.train_step(trainer.loader(trainer.train_data, 0))
    loads = trainer.moe_monitor.report(grid.stage_group, grid.pp_group)
    return {
        "layers": torch.tensor([load.layer for load in loads]),
        "routed": torch.tensor([sum(load.tokens_per_expert) for load in loads]),
    }


def test_the_moe_log_shows_every_stages_layers(corpus) -> None:
    for result in run_distributed(_moe_layers_reported, 2, corpus):
        assert result["layers"].tolist() == [2, 4]
        assert result["routed"].tolist() == [4 * 16, 4 * 16]  # a global batch of 4 x 16 tokens, top-1, dropless
