"""ZeRO stages 1-3 equal stage 0 and a single process, hold about 1/N of the optimizer state
(and under stage 3 of the parameters) per rank, and checkpoint in a layout that loads under
another stage and data-parallel size."""

import json
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from megatron.model.moe import MoEConfig, MoELayer
from megatron.parallel import ParallelGrid, build_parallel_grid, single_process_grid
from megatron.placement import expert_ids
from megatron.runtime import initialize
from megatron.runtime.engine import Engine
from megatron.runtime.zero.buffer_pool import BufferPool
from megatron.training.loop import Trainer
from tests.dist_utils import run_distributed
from tests.training_fixtures import MODERN_MOE, tiny_config, write_corpus

H, GLOBAL_BATCH, MICRO_BATCH, STEPS, SAVE_AT = 15, 8, 2, 5, 3
# token-wise routing without capacity drops or an aux loss: two ranks on half the batch each
# see exactly what one process sees on all of it
ROUTING = MoEConfig(topk=1, drop_tokens=False, use_rts=False, sample_second_expert=False, aux_loss_coeff=0.0)


class Net(nn.Module):
    def __init__(self, moe: bool, ep_group: torch.distributed.ProcessGroup | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.norm, self.out = nn.Linear(H, H), nn.LayerNorm(H), nn.Linear(H, 1)
        torch.manual_seed(1)  # experts are initialised by global id, whatever the EP size
        self.moe = MoELayer(H, 2 * H, 4, ROUTING, init_std=0.2, output_init_std=0.1, ep_group=ep_group) if moe else None

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        h_BSH = self.norm(torch.tanh(self.inp(x_BSH)))
        if self.moe is not None:
            h_BSH = h_BSH + self.moe(h_BSH).hidden_BSH
        return self.out(h_BSH)


# stage 3 with every parameter partitioned (no persistent small ones) and a prefetch of about
# one module; stage 2 with small buckets reduced while backward runs
ZERO = {
    0: {"stage": 0},
    1: {"stage": 1},
    2: {"stage": 2},
    "2-buckets": {"stage": 2, "reduce_bucket_size": 100, "overlap_comm": True},
    3: {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 300},
    "3-sync": {"stage": 3, "stage3_param_persistence_threshold": 0, "overlap_comm": False},
}
PARTITIONED = (1, 2, "2-buckets", 3, "3-sync")


def make_engine(grid: ParallelGrid, moe: bool, stage: int | str) -> Engine:
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
        "gradient_clipping": 0.5,
        "zero_optimization": ZERO[stage],
    }
    return initialize(Net(moe, grid.ep_group), config, grid)


def train(engine: Engine, first: int, last: int, save: str | None = None) -> None:
    """Steps first..last-1 of a fixed global batch sequence; this rank takes its share of rows."""
    grid = engine.parallel
    rows = GLOBAL_BATCH // grid.dp_size
    for step in range(first, last):
        generator = torch.Generator().manual_seed(step)
        x, y = (
            torch.randn(GLOBAL_BATCH, 3, H, generator=generator),
            5 * torch.randn(GLOBAL_BATCH, 3, 1, generator=generator),
        )
        x, y = x[grid.dp_rank * rows : (grid.dp_rank + 1) * rows], y[grid.dp_rank * rows : (grid.dp_rank + 1) * rows]
        for micro in range(0, rows, MICRO_BATCH):
            engine.backward(((engine(x[micro : micro + MICRO_BATCH]) - y[micro : micro + MICRO_BATCH]) ** 2).mean())
            engine.step()
        if save is not None and step + 1 == SAVE_AT:
            engine.save_checkpoint(save, "ckpt")


def parameters(engine: Engine, label: str) -> dict[str, torch.Tensor]:
    """Dense parameters by name, experts by global id (gathered whole under stage 3)."""
    out = {}
    with engine.whole_parameters():
        for name, param in engine.module.named_parameters():
            ids = expert_ids(param)
            if ids is None:
                out[f"{label}/{name}"] = param.detach().clone()
            else:
                out.update({f"{label}/{name}[{g}]": param[i].detach().clone() for i, g in enumerate(ids)})
    return out


def state_numel(engine: Engine) -> int:
    return sum(v.numel() for state in engine.optimizer.state.values() for v in state.values() if v.dim() > 0)


def held_parameter_numel(engine: Engine) -> int:
    """fp32 parameter elements a rank holds between steps, each storage once: the model's tensors
    (empty while partitioned, views of one buffer under ZeRO) and the master shards."""
    tensors = [*engine.module.parameters(), *(p.shard for p in engine.strategy.partitions)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values()) // 4


LAYER_NUMEL = 16 * 16 + 16  # one layer's weight and bias, each padded to an even length already


def deep_stack_peak(grid: ParallelGrid, prefetch: int) -> tuple[int, int]:
    """Most parameter elements gathered at once while training a stack of 8 equal layers under
    stage 3 (nothing persistent) with the given prefetch; and how many gathered buffers are still
    in use when the last forward returns (autograd must not hold freed ones; the buffer pool keeps
    freed ones for reuse)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(8)))
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": prefetch}
    engine = initialize(model, {"train_batch_size": 4, "zero_optimization": zero}, grid)
    part = engine.strategy.partitions[0]
    attach, gathered = part._attach, []

    def recording_attach(bucket: Any, full: torch.Tensor) -> None:
        attach(bucket, full)
        gathered.append(weakref.ref(part.params[bucket.params[0]].untyped_storage()))

    part._attach = recording_attach
    for step in range(3):
        x = torch.randn(2, 16, generator=torch.Generator().manual_seed(step))
        gathered.clear()
        loss = engine(x).square().mean()
        pooled = {buffer.data_ptr() for waiting in part.pool.free.values() for buffer in waiting}
        in_use = {ref().data_ptr() for ref in gathered if ref() is not None} - pooled
        alive = len(in_use)  # a pooled buffer may have served several gathers
        engine.backward(loss)
        engine.step()
    return engine.strategy.gatherer.peak_live_numel, alive


def _two_ranks(save: str) -> dict[str, torch.Tensor]:
    grids = {ep: build_parallel_grid(torch.device("cpu"), ep_size=ep) for ep in (1, 2)}
    out: dict[str, torch.Tensor] = {}
    for moe, ep in ((False, 1), (True, 1), (True, 2)):
        for stage in (0, *PARTITIONED):
            engine = make_engine(grids[ep], moe, stage)
            checkpoint = save + f"/stage{stage}" if moe and ep == 1 and stage in (1, 3) else None
            train(engine, 0, STEPS, checkpoint)
            label = f"moe{moe:d}-ep{ep}-stage{stage}"
            out[f"numel/{label}"] = torch.tensor(state_numel(engine))
            out[f"held/{label}"] = torch.tensor(held_parameter_numel(engine))
            out[f"grads/{label}"] = torch.tensor(
                sum(p.grad.numel() for p in engine.module.parameters() if p.grad is not None)
            )
            out.update(parameters(engine, label))
    # saved with EP=1 under stage 1 (stage 3): load with EP=2 under stage 3 (stage 2)
    for prefetch in (0, 2 * LAYER_NUMEL):
        out[f"peak/prefetch{prefetch}"], out[f"alive/prefetch{prefetch}"] = map(
            torch.tensor, deep_stack_peak(grids[1], prefetch)
        )
    for saved, loaded in ((1, 3), (3, 2)):
        resumed = make_engine(grids[2], True, loaded)
        resumed.load_checkpoint(save + f"/stage{saved}", "ckpt")
        train(resumed, SAVE_AT, STEPS)
        out.update(parameters(resumed, f"resumed{saved}"))
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[list[dict[str, torch.Tensor]], str]:
    save = str(tmp_path_factory.mktemp("zero_ckpt"))
    return run_distributed(_two_ranks, 2, save), save


def single_process(moe: bool, load: str | None = None, stage: int = 0) -> dict[str, torch.Tensor]:
    engine = make_engine(single_process_grid(torch.device("cpu")), moe, stage)
    if load is not None:
        engine.load_checkpoint(load, "ckpt")
    train(engine, SAVE_AT if load else 0, STEPS)
    return parameters(engine, "single")


@pytest.fixture(scope="module")
def one_process() -> dict[bool, dict[str, torch.Tensor]]:
    """The single-process reference run, dense and MoE."""
    return {moe: single_process(moe) for moe in (False, True)}


@pytest.mark.parametrize("stage", PARTITIONED)
@pytest.mark.parametrize("moe, ep", [(False, 1), (True, 1), (True, 2)])
def test_stages_1_to_3_equal_stage_0_and_one_process(two_ranks, one_process, moe, ep, stage):
    results, _ = two_ranks
    single = one_process[moe]
    label = f"moe{moe:d}-ep{ep}-stage{stage}"
    for rank, result in enumerate(results):
        keys = [k for k in result if k.startswith(label + "/")]
        assert keys
        for key in keys:
            name = key.split("/", 1)[1]
            torch.testing.assert_close(
                result[key],
                result[f"moe{moe:d}-ep{ep}-stage0/{name}"],
                rtol=1e-5,
                atol=1e-6,
                msg=f"rank {rank} {key} vs stage 0",
            )
            torch.testing.assert_close(
                result[key], single[f"single/{name}"], rtol=1e-4, atol=1e-5, msg=f"rank {rank} {key} vs one process"
            )


def test_optimizer_state_per_rank_is_about_half(two_ranks):
    results, _ = two_ranks
    for result in results:
        for label in ("moe0-ep1", "moe1-ep1"):  # all parameters, experts included, are split over 2 ranks
            stage0 = int(result[f"numel/{label}-stage0"])
            for stage in PARTITIONED:
                # exp_avg and exp_avg_sq, each bucket padded by at most one element
                buckets = 12 if stage in (3, "3-sync", "2-buckets") else 2
                assert stage0 / 2 <= int(result[f"numel/{label}-stage{stage}"]) <= stage0 / 2 + 2 * buckets
        # with EP=2 on 2 ranks each expert has one copy: only the dense half is split
        assert int(result["numel/moe1-ep2-stage1"]) < int(result["numel/moe1-ep2-stage0"])


def test_stage_3_holds_half_the_parameters_and_stages_2_3_no_whole_gradients(two_ranks):
    results, _ = two_ranks
    for result in results:
        for label in ("moe0-ep1", "moe1-ep1"):
            whole = int(result[f"held/{label}-stage0"])
            for stage in (3, "3-sync"):
                assert whole / 2 <= int(result[f"held/{label}-stage{stage}"]) <= whole / 2 + 12
        assert int(result["held/moe1-ep2-stage3"]) < int(result["held/moe1-ep2-stage0"])
        # stage 1 keeps whole gradients for accumulation; stages 2 and 3 free each bucket once reduced
        for label in ("moe0-ep1", "moe1-ep1"):
            assert int(result[f"grads/{label}-stage1"]) == int(result[f"held/{label}-stage0"])
            for stage in (2, "2-buckets", 3, "3-sync"):
                assert int(result[f"grads/{label}-stage{stage}"]) == 0
        # one layer at a time without prefetch; with a prefetch of two layers, three at most
        assert int(result["peak/prefetch0"]) == LAYER_NUMEL
        assert 2 * LAYER_NUMEL <= int(result[f"peak/prefetch{2 * LAYER_NUMEL}"]) <= 3 * LAYER_NUMEL
        # after forward, memory holds what the gatherer counts as live and nothing else: the
        # prefetched first layers of backward at most, not every layer's buffer kept by autograd
        assert int(result["alive/prefetch0"]) == 0
        assert int(result[f"alive/prefetch{2 * LAYER_NUMEL}"]) <= 3


@pytest.mark.parametrize("saved", [1, 3])
def test_checkpoint_from_stage_1_or_3_loads_under_one_process_and_other_stages_expert_parallel(two_ranks, saved):
    results, save = two_ranks
    single = single_process(True, load=f"{save}/stage{saved}")
    for rank, result in enumerate(results):
        keys = [k for k in result if k.startswith(f"resumed{saved}/")]
        assert keys
        for key in keys:
            name = key.split("/", 1)[1]
            uninterrupted = result[f"moe1-ep2-stage0/{name}"]
            # resumed under another stage and EP size: sums run in another order (up to 7e-6 apart on an AMD EPYC)
            torch.testing.assert_close(result[key], uninterrupted, rtol=1e-4, atol=1e-5, msg=f"rank {rank} {key}")
            torch.testing.assert_close(single[f"single/{name}"], uninterrupted, rtol=1e-4, atol=1e-5, msg=name)


# GPT with a tied embedding (read again by the LM head), MoE layers and recomputed activations
RUNS = {
    "dense": {},
    "moe": {"num_experts": 4, "checkpoint_activations": True},
    "modern": MODERN_MOE,
}


def _trainer_parameters(corpus: str, stage3_json: str) -> dict[str, torch.Tensor]:
    grid = build_parallel_grid(torch.device("cpu"))
    out = {}
    for run, flags in RUNS.items():
        for stage in (0, 1, 2, 3):
            zero = {"zero_stage": stage} if stage < 3 else {"deepspeed": True, "deepspeed_config": stage3_json}
            config = tiny_config(
                corpus,
                dp_size=grid.dp_size,
                train_iters=4,
                micro_batch_size=1,
                global_batch_size=4,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                **zero,
                **flags,
            )
            trainer = Trainer(config, grid)
            out[f"{run}{stage}/losses"] = torch.tensor(trainer.train().losses, dtype=torch.float64)
            with trainer.engine.whole_parameters():
                out.update(
                    {f"{run}{stage}/{name}": p.detach().clone() for name, p in trainer.engine.module.named_parameters()}
                )
    return out


def test_trainer_with_zero_stage_flag_or_json_equals_stage_0(tmp_path):
    corpus = write_corpus(tmp_path)
    stage3_json = tmp_path / "ds.json"
    stage3_json.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    for result in run_distributed(_trainer_parameters, 2, corpus, str(stage3_json)):
        for run in RUNS:
            keys = [k for k in result if k.startswith(f"{run}0/")]
            assert len(keys) > 5
            for key in keys:
                name = key.split("/", 1)[1]
                for stage in (1, 2, 3):
                    # each stage sums gradients in its own order: round-off differs by CPU (AMD EPYC: ~1e-5)
                    torch.testing.assert_close(
                        result[f"{run}{stage}/{name}"], result[key], rtol=1e-4, atol=1e-5, msg=f"{run}{stage}/{name}"
                    )


def _four_ranks(two_rank_save: str, save: str) -> dict[str, torch.Tensor]:
    grid = build_parallel_grid(torch.device("cpu"), ep_size=2)  # experts: EP 2 x expert-DP 2
    out: dict[str, torch.Tensor] = {}
    for moe in (False, True):
        for stage in (1, 2, 3):
            engine = make_engine(grid, moe, stage)
            train(engine, 0, STEPS, save if moe and stage == 3 else None)
            out.update(parameters(engine, f"moe{moe:d}-stage{stage}"))
            out[f"numel/moe{moe:d}-stage{stage}"] = torch.tensor(state_numel(engine))
    resumed = make_engine(grid, True, 3)  # saved on 2 ranks (EP=1, stage 1), resumed on 4 (EP=2, stage 3)
    resumed.load_checkpoint(two_rank_save + "/stage1", "ckpt")
    train(resumed, SAVE_AT, STEPS)
    out.update(parameters(resumed, "resumed"))
    return out


def test_four_ranks_equal_one_process_with_a_quarter_of_the_dense_state_and_checkpoints_move(two_ranks, tmp_path):
    _, two_rank_save = two_ranks
    results = run_distributed(_four_ranks, 4, two_rank_save, str(tmp_path))
    for moe in (False, True):
        single = single_process(moe)
        full_state = 2 * sum(p.numel() for p in Net(moe, None).parameters())  # Adam: exp_avg and exp_avg_sq
        for rank, result in enumerate(results):
            for stage in (1, 2, 3):
                label = f"moe{moe:d}-stage{stage}"
                for key in (k for k in result if k.startswith(label + "/")):
                    torch.testing.assert_close(
                        result[key],
                        single[f"single/{key.split('/', 1)[1]}"],
                        rtol=1e-4,
                        atol=1e-5,
                        msg=f"rank {rank} {key}",
                    )
                if not moe:  # padding to a multiple of 4 adds at most 3 elements per bucket (5 under stage 3)
                    assert int(result[f"numel/{label}"]) <= full_state // 4 + 2 * 3 * (5 if stage == 3 else 2)
    # saved on 4 ranks under stage 3, resumed in one process; saved on 2 ranks, resumed on 4
    uninterrupted = single_process(True)
    from_four = single_process(True, load=str(tmp_path))
    for result in results:
        keys = [k for k in result if k.startswith("resumed/")]
        assert keys
        for key in keys:
            name = key.split("/", 1)[1]
            torch.testing.assert_close(result[key], uninterrupted[f"single/{name}"], rtol=1e-4, atol=1e-5, msg=key)
            torch.testing.assert_close(
                from_four[f"single/{name}"], result[f"moe1-stage3/{name}"], rtol=1e-4, atol=1e-5, msg=name
            )


def test_buffer_pool_reuses_only_buffers_nothing_else_views():
    pool, cpu = BufferPool(per_size=1), torch.device("cpu")
    first = pool.take(8, torch.float32, cpu)
    address = first.data_ptr()
    view = first[2:4]
    pool.give(first)  # still viewed: not kept
    assert pool.take(8, torch.float32, cpu).data_ptr() != address
    del view
    pool.give(first)
    pool.give(torch.empty(8))  # one of a size waits at most
    assert pool.take(8, torch.float32, cpu).data_ptr() == address
    assert pool.free == {(8, torch.float32): []}  # the second buffer given was not kept
