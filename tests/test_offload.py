"""Optimizer offload: Adam state in host memory (CPU Adam) or in NVMe swap files (pipelined or
not) gives bit for bit the parameters of the in-memory optimizer under ZeRO stages 1-3, with MoE;
so does stage-3 parameter offload (the master shards in swap files, read ahead through a few
buffers); both resume from a checkpoint taken while swapping; and fail with clear errors."""

import gc
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megatron.errors import ConfigError, UserError
from megatron.model.moe import MoEConfig, MoELayer
from megatron.parallel import ParallelGrid, build_parallel_grid, single_process_grid
from megatron.runtime import initialize
from megatron.runtime.engine import Engine
from megatron.runtime.swap.slots import SwapError
from megatron.training.loop import Trainer
from tests.dist_utils import run_distributed
from tests.training_fixtures import MODERN_MOE, tiny_config, write_corpus

H, BATCH, STEPS, SAVE_AT = 24, 8, 10, 5
ROUTING = MoEConfig(topk=1, drop_tokens=False, use_rts=False, sample_second_expert=False, aux_loss_coeff=0.0)
OFFLOADS = {
    "memory": None,
    "cpu": {"device": "cpu"},
    "nvme": {"device": "nvme"},
    "nvme-pipelined": {"device": "nvme", "pipeline_read": True, "pipeline_write": True, "buffer_count": 3},
}
# stage-3 parameter offload: host memory; every element swapped through one buffer; all but 1024
# elements per rank swapped (a shard cut between memory and file) through two
PARAM_OFFLOADS = {
    "params-cpu": {"device": "cpu"},
    "params-nvme": {"device": "nvme", "max_in_cpu": 0, "buffer_count": 1},
    "params-nvme-1024": {"device": "nvme", "max_in_cpu": 1024, "buffer_count": 2},
}


class Net(nn.Module):
    """Shards of a few thousand elements: several 1024-element sub-groups each."""

    def __init__(self, moe: bool, ep_group: torch.distributed.ProcessGroup | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(H, 4 * H), nn.Linear(4 * H, 1)
        self.moe = (
            MoELayer(4 * H, 2 * H, 4, ROUTING, init_std=0.1, output_init_std=0.05, ep_group=ep_group) if moe else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.moe is not None:
            h = h + self.moe(h).hidden_BSH
        return self.out(h)


def make_engine(
    grid: ParallelGrid,
    moe: bool,
    stage: int,
    offload: str,
    swap_dir: str,
    sub_group: int = 1024,
    params: str | None = None,
) -> Engine:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0, "sub_group_size": sub_group}
    if OFFLOADS[offload] is not None:
        zero["offload_optimizer"] = {**OFFLOADS[offload], "nvme_path": swap_dir}
    if params is not None:
        zero["offload_param"] = {**PARAM_OFFLOADS[params], "nvme_path": swap_dir}
    config = {
        "train_batch_size": BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "aio": {"block_size": 8192, "queue_depth": 4},
    }
    return initialize(Net(moe, grid.ep_group), config, grid)


def train(engine: Engine, first: int, last: int) -> None:
    grid = engine.parallel
    rows = BATCH // grid.dp_size
    for step in range(first, last):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, 3, H, generator=generator), torch.randn(BATCH, 3, 1, generator=generator)
        part = slice(grid.dp_rank * rows, (grid.dp_rank + 1) * rows)
        engine.backward(((engine(x[part]) - y[part]) ** 2).mean())
        engine.step()


def parameters(engine: Engine, label: str) -> dict[str, torch.Tensor]:
    with engine.whole_parameters():
        return {f"{label}/{name}": p.detach().clone() for name, p in engine.module.named_parameters()}


def _two_ranks(swap_dir: str) -> dict[str, torch.Tensor]:
    grids = {ep: build_parallel_grid(torch.device("cpu"), ep_size=ep) for ep in (1, 2)}
    out: dict[str, torch.Tensor] = {}
    for moe, ep in ((False, 1), (True, 2)):
        for stage in (1, 2, 3):
            for offload in OFFLOADS:
                engine = make_engine(grids[ep], moe, stage, offload, swap_dir)
                train(engine, 0, STEPS)
                out.update(parameters(engine, f"{moe:d}-{stage}-{offload}"))
        for params in PARAM_OFFLOADS:
            engine = make_engine(grids[ep], moe, 3, "nvme-pipelined", swap_dir, params=params)
            train(engine, 0, STEPS)
            out.update(parameters(engine, f"{moe:d}-3-{params}"))
    # a checkpoint taken while swapping resumes into swapping with other sub-groups, and into memory
    saved = make_engine(grids[2], True, 2, "nvme-pipelined", swap_dir)
    train(saved, 0, SAVE_AT)
    saved.save_checkpoint(swap_dir + "/ckpt", "tag")
    for offload, sub_group in (("nvme", 2048), ("memory", 1024)):
        resumed = make_engine(grids[2], True, 3, offload, swap_dir, sub_group)
        resumed.load_checkpoint(swap_dir + "/ckpt", "tag")
        train(resumed, SAVE_AT, STEPS)
        out.update(parameters(resumed, f"resumed-{offload}"))
    # and one taken while the parameters are swapped, into a run that keeps more of them in memory
    saved = make_engine(grids[2], True, 3, "nvme", swap_dir, params="params-nvme")
    train(saved, 0, SAVE_AT)
    saved.save_checkpoint(swap_dir + "/ckpt", "params")
    resumed = make_engine(grids[2], True, 3, "nvme-pipelined", swap_dir, params="params-nvme-1024")
    resumed.load_checkpoint(swap_dir + "/ckpt", "params")
    train(resumed, SAVE_AT, STEPS)
    out.update(parameters(resumed, "resumed-params"))
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict[str, torch.Tensor]]:
    return run_distributed(_two_ranks, 2, str(tmp_path_factory.mktemp("swap")))


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_optimizer_equals_in_memory_bit_for_bit(two_ranks, moe, stage):
    for result in two_ranks:
        reference = {k.split("/", 1)[1]: v for k, v in result.items() if k.startswith(f"{moe:d}-{stage}-memory/")}
        assert reference
        for offload in ("cpu", "nvme", "nvme-pipelined"):
            for name, value in reference.items():
                assert torch.equal(result[f"{moe:d}-{stage}-{offload}/{name}"], value), f"{offload} {name}"


@pytest.mark.parametrize("moe", [False, True])
def test_swapped_parameters_equal_in_memory_bit_for_bit(two_ranks, moe):
    for result in two_ranks:
        reference = {k.split("/", 1)[1]: v for k, v in result.items() if k.startswith(f"{moe:d}-3-memory/")}
        assert reference
        for params in PARAM_OFFLOADS:
            for name, value in reference.items():
                assert torch.equal(result[f"{moe:d}-3-{params}/{name}"], value), f"{params} {name}"


def test_checkpoint_taken_while_swapping_resumes(two_ranks):
    for result in two_ranks:
        for resumed, stage in (("nvme", 2), ("memory", 2), ("params", 3)):
            keys = [k for k in result if k.startswith(f"resumed-{resumed}/")]
            assert keys
            for key in keys:
                uninterrupted = result[f"1-{stage}-memory/{key.split('/', 1)[1]}"]
                torch.testing.assert_close(result[key], uninterrupted, rtol=1e-6, atol=1e-7, msg=key)


def _four_ranks(swap_dir: str) -> dict[str, torch.Tensor]:
    grid = build_parallel_grid(torch.device("cpu"), ep_size=2)  # experts: EP 2 x expert-DP 2
    out: dict[str, torch.Tensor] = {}
    for params in (None, "params-nvme", "params-nvme-1024"):
        engine = make_engine(grid, True, 3, "memory" if params is None else "nvme-pipelined", swap_dir, params=params)
        train(engine, 0, SAVE_AT)
        out.update(parameters(engine, params or "memory"))
    return out


def test_swapped_parameters_on_four_ranks_equal_in_memory_bit_for_bit(tmp_path):
    for result in run_distributed(_four_ranks, 4, str(tmp_path)):
        names = [k.split("/", 1)[1] for k in result if k.startswith("memory/")]
        assert len(names) > 5
        for params in ("params-nvme", "params-nvme-1024"):
            for name in names:
                assert torch.equal(result[f"{params}/{name}"], result[f"memory/{name}"]), f"{params} {name}"


def single_engine(tmp_path: Path, **offload: object) -> Engine:
    config = {
        "train_batch_size": 2,
        "zero_optimization": {
            "stage": 1,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), **offload},
        },
    }
    return initialize(Net(False, None), config, single_process_grid(torch.device("cpu")))


def test_swap_folder_is_per_run_and_removed(tmp_path):
    first, second = single_engine(tmp_path), single_engine(tmp_path)
    folders = {first.optimizer.folder.path, second.optimizer.folder.path}
    assert len(folders) == 2 and all(f.parent.parent == tmp_path and f.name == "rank0" for f in folders)
    assert all(any(f.glob("*.swp")) for f in folders)  # zeros written at start-up (no fast_init)
    first.optimizer.folder.remove()
    assert not first.optimizer.folder.run_root.exists() and second.optimizer.folder.path.exists()
    fast = single_engine(tmp_path, fast_init=True)
    assert not any(fast.optimizer.folder.path.glob("*.swp"))
    # an engine's swap files go when the engine does, the parameters' too
    swapping = swapping_engine(tmp_path)
    folders = [fast.optimizer.folder.path, swapping.optimizer.folder.path, swapping.strategy.swapper.folder.path]
    assert all(f.exists() for f in folders) and any(folders[2].glob("params*.swp"))
    del fast, swapping
    gc.collect()
    assert not any(f.exists() for f in folders)


def test_offload_errors_are_clear(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="buffer_count 2 is too few .* at least 3"):
        single_engine(tmp_path, pipeline_read=True, pipeline_write=True, buffer_count=2)
    with pytest.raises(ConfigError, match="needs zero_optimization.offload_optimizer.nvme_path"):
        single_engine(tmp_path, nvme_path=None)
    own = Net(False, None)
    with pytest.raises(ConfigError, match="offload_optimizer to cpu needs the optimizer the config builds, but a SGD"):
        initialize(
            own,
            {"train_batch_size": 2, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
            single_process_grid(torch.device("cpu")),
            optimizer=torch.optim.SGD(own.parameters(), lr=0.1),
        )
    with pytest.raises(ConfigError, match="offload_optimizer needs ZeRO"):
        initialize(
            Net(False, None),
            {"train_batch_size": 2, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
            single_process_grid(torch.device("cpu")),
        )
    monkeypatch.setattr("shutil.disk_usage", lambda path: SimpleNamespace(total=10**12, used=10**12 - 100, free=100))
    with pytest.raises(ConfigError, match=r"needs [\d,]+ bytes .* has 100 free"):
        single_engine(tmp_path)


def test_a_failed_swap_stops_training_with_a_clear_error(tmp_path):
    engine = single_engine(tmp_path)
    for path in engine.optimizer.folder.path.glob("*.swp"):
        path.unlink()  # the disk lost the files: the next read fails
    engine.backward(engine(torch.randn(2, 3, H)).square().mean())
    with pytest.raises(SwapError, match="swapping optimizer state failed .* the last checkpoint is intact"):
        engine.step()


def swapping_engine(tmp_path: Path, **params: object) -> Engine:
    """One process, stage 3, the whole master in swap files unless `params` say otherwise."""
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0, **params},
    }
    config = {
        "train_batch_size": BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
    }
    return initialize(Net(True, None), config, single_process_grid(torch.device("cpu")))


def test_one_process_swaps_parameters_reads_them_ahead_and_holds_none_between_uses(tmp_path, monkeypatch):
    grid = single_process_grid(torch.device("cpu"))
    reference = make_engine(grid, True, 3, "memory", str(tmp_path))
    train(reference, 0, STEPS)
    engine = swapping_engine(tmp_path, buffer_count=2)
    parts = engine.strategy.partitions
    assert parts and all(p.store.swapped and p.store.memory.numel() == 0 for p in parts)
    assert all(p.shard.untyped_storage().nbytes() == 4 for p in parts)  # the optimizer's stand-in
    in_use: list[int] = []
    claim = type(engine.strategy.swapper).claim

    def counting_claim(swapper):
        slot = claim(swapper)
        in_use.append(len(swapper.slots) - len(swapper.free))
        return slot

    monkeypatch.setattr(type(engine.strategy.swapper), "claim", counting_claim)
    train(engine, 0, STEPS)
    assert max(in_use) == 2  # reads ahead of use, never more than buffer_count at once
    assert all(p.numel() == 0 for p in engine.module.parameters())  # nothing gathered between steps
    expected, got = parameters(reference, "x"), parameters(engine, "x")
    assert expected.keys() == got.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def test_parameter_offload_errors_are_clear(tmp_path, monkeypatch):
    net, grid = Net(False, None), single_process_grid(torch.device("cpu"))
    with pytest.raises(ConfigError, match="offload_param needs zero_optimization.stage 3 .* got stage 2"):
        initialize(
            net, {"train_batch_size": 2, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, grid
        )
    with pytest.raises(ConfigError, match='offload_param to nvme needs offload_optimizer.device "nvme" too'):
        initialize(
            net,
            {
                "train_batch_size": 2,
                "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}},
            },
            grid,
        )
    with pytest.raises(ConfigError, match="needs zero_optimization.offload_param.nvme_path"):
        swapping_engine(tmp_path, nvme_path=None)
    with pytest.raises(
        ConfigError, match="offload_param.buffer_size 100 is smaller than a parameter piece .* at least 3,072"
    ):
        swapping_engine(tmp_path, buffer_size=100)
    monkeypatch.setattr("shutil.disk_usage", lambda path: SimpleNamespace(total=10**12, used=10**12 - 100, free=100))
    with pytest.raises(ConfigError, match=r"needs [\d,]+ bytes for this rank's parameter partitions .* has 100 free"):
        swapping_engine(tmp_path)


def test_a_failed_parameter_swap_stops_training_with_a_clear_error(tmp_path):
    engine = swapping_engine(tmp_path)
    for path in engine.strategy.swapper.folder.path.glob("params*.swp"):
        path.unlink()
    with pytest.raises(SwapError, match="swapping parameter partitions failed .* the last checkpoint is intact"):
        engine(torch.randn(2, 3, H))


def _trainer_parameters(corpus: str, configs: dict[str, str], model: dict) -> dict[str, torch.Tensor]:
    grid = build_parallel_grid(torch.device("cpu"))
    out: dict[str, torch.Tensor] = {}
    for label, ds_json in configs.items():
        config = tiny_config(
            corpus,
            dp_size=grid.dp_size,
            train_iters=4,
            micro_batch_size=1,
            global_batch_size=4,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            checkpoint_activations=True,
            deepspeed=True,
            deepspeed_config=ds_json,
            **{"num_experts": 4, **model},
        )
        trainer = Trainer(config, grid)
        trainer.train()
        with trainer.engine.whole_parameters():
            out.update({f"{label}/{name}": p.detach().clone() for name, p in trainer.engine.module.named_parameters()})
    return out


@pytest.mark.parametrize("model", [{}, MODERN_MOE], ids=["classic", "modern"])
def test_trainer_with_parameters_and_optimizer_on_nvme_equals_stage_3_in_memory(tmp_path, model):
    """A GPT with MoE and recomputed activations (the classic one with a tied embedding, today's
    architecture with an untied head), configured by a DeepSpeed JSON."""
    corpus = write_corpus(tmp_path)
    stage3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
    nvme = {"device": "nvme", "nvme_path": str(tmp_path / "swap")}
    configs = {
        "memory": stage3,
        "nvme": {
            **stage3,
            "offload_optimizer": {**nvme, "pipeline_read": True, "buffer_count": 2},
            "offload_param": {**nvme, "max_in_cpu": 0},
        },
    }
    for label, zero in configs.items():
        (tmp_path / f"{label}.json").write_text(json.dumps({"zero_optimization": zero}))
    paths = {label: str(tmp_path / f"{label}.json") for label in configs}
    for result in run_distributed(_trainer_parameters, 2, corpus, paths, model):
        names = [k.split("/", 1)[1] for k in result if k.startswith("memory/")]
        assert len(names) > 5
        for name in names:
            assert torch.equal(result[f"nvme/{name}"], result[f"memory/{name}"]), name
