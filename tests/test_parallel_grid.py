"""The rank grid: tensor-, data-, pipeline- and expert-parallel groups in Megatron-Core's layout
(tp fastest, then dp, then pp), computed as a pure function and built as real process groups."""

import itertools

import pytest
import torch
import torch.distributed as dist

from megatron.errors import ConfigError
from megatron.parallel import (
    ParallelGrid,
    build_parallel_grid,
    launched_world_size,
    position_in,
    rank_layout,
    single_process_grid,
)
from tests.dist_utils import run_distributed

PARTITIONS = ("tp", "dp", "pp", "expert_tp", "ep", "expert_dp")  # the kinds that cover every rank once


def test_tp2_pp2_on_eight_ranks_follows_megatron_core():
    layout = rank_layout(8, tp_size=2, pp_size=2, ep_size=2)
    assert layout.tp == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert layout.dp == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert layout.pp == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert layout.embedding == layout.pp  # two stages: the first and last are the whole pipeline
    # experts re-divide each stage's 4 ranks as ep 2 x expert-dp 2
    assert layout.ep == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert layout.expert_dp == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert layout.expert_tp == tuple((rank,) for rank in range(8))


@pytest.mark.parametrize("world_size, ep_size", [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (6, 3), (8, 2), (8, 4)])
def test_without_tp_and_pp_experts_keep_consecutive_ep_and_strided_expert_dp_groups(world_size, ep_size):
    layout = rank_layout(world_size, ep_size=ep_size)
    assert layout.ep == tuple(tuple(range(first, first + ep_size)) for first in range(0, world_size, ep_size))
    assert layout.expert_dp == tuple(tuple(range(offset, world_size, ep_size)) for offset in range(ep_size))
    assert layout.dp == (tuple(range(world_size)),)
    assert layout.tp == layout.pp == layout.expert_tp == tuple((rank,) for rank in range(world_size))
    assert layout.embedding == ()
    for rank in range(world_size):
        assert (position_in(layout.ep, rank), position_in(layout.expert_dp, rank)) == divmod(rank, ep_size)[::-1]


def _valid_sizes(world_size: int):
    for tp, pp, ep, etp in itertools.product((1, 2, 4), (1, 2, 4), (1, 2, 4), (1, 2)):
        if world_size % (tp * pp) == 0 and (world_size // pp) % (ep * etp) == 0:
            yield tp, pp, ep, etp


@pytest.mark.parametrize("world_size", [1, 2, 4, 8, 16])
def test_every_kind_of_group_partitions_the_world_once(world_size):
    for tp, pp, ep, etp in _valid_sizes(world_size):
        layout = rank_layout(world_size, tp, pp, ep, etp)
        dp, expert_dp = world_size // (tp * pp), world_size // (pp * ep * etp)
        sizes = {"tp": tp, "dp": dp, "pp": pp, "expert_tp": etp, "ep": ep, "expert_dp": expert_dp}
        for kind in PARTITIONS:
            groups = getattr(layout, kind)
            assert sorted(itertools.chain(*groups)) == list(range(world_size)), (kind, tp, pp, ep, etp)
            assert {len(ranks) for ranks in groups} == {sizes[kind]}, (kind, tp, pp, ep, etp)
        # the dense axes are orthogonal: a tp group and a dp group share at most one rank
        assert all(len(set(a) & set(b)) <= 1 for a in layout.tp for b in layout.dp)
        # expert groups stay inside one pipeline stage
        stage = {rank: position_in(layout.pp, rank) for rank in range(world_size)}
        assert all(
            len({stage[rank] for rank in ranks}) == 1
            for kind in ("expert_tp", "ep", "expert_dp")
            for ranks in getattr(layout, kind)
        )


def test_expert_tensor_parallel_is_fastest_then_ep_then_expert_dp():
    layout = rank_layout(8, tp_size=2, ep_size=2, expert_tp_size=2)
    assert layout.expert_tp == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert layout.ep == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert layout.expert_dp == ((0, 4), (1, 5), (2, 6), (3, 7))
    staged = rank_layout(16, tp_size=2, pp_size=2, ep_size=2, expert_tp_size=2)
    assert staged.expert_dp == ((0, 4), (1, 5), (2, 6), (3, 7), (8, 12), (9, 13), (10, 14), (11, 15))
    assert staged.ep[-1] == (13, 15)


def test_embedding_group_is_first_and_last_stage():
    layout = rank_layout(8, tp_size=2, pp_size=4)
    assert layout.pp == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert layout.embedding == ((0, 6), (1, 7))


def test_pipeline_neighbours_and_description():
    cpu = torch.device("cpu")
    # rank 5 of tp 2 x dp 2 x pp 2: tp rank 1, dp rank 0, last stage
    last = ParallelGrid(
        8, 5, 2, 0, None, cpu, ep_size=2, ep_rank=1, expert_dp_size=2, tp_size=2, tp_rank=1, pp_size=2, pp_rank=1
    )
    assert (last.is_first_stage, last.is_last_stage, last.pp_prev_rank, last.pp_next_rank) == (False, True, 1, None)
    first = ParallelGrid(8, 1, 2, 0, None, cpu, tp_size=2, tp_rank=1, pp_size=2, pp_rank=0)
    assert (first.is_first_stage, first.is_last_stage, first.pp_prev_rank, first.pp_next_rank) == (True, False, None, 5)
    assert last.describe() == "world 8 = tp 2 x dp 2 x pp 2; ep 2 x etp 1 x expert-dp 2"
    single = single_process_grid(cpu)
    assert single.describe() == "world 1 = tp 1 x dp 1 x pp 1; ep 1 x etp 1 x expert-dp 1"
    assert single.is_first_stage and single.is_last_stage and single.pp_prev_rank is single.pp_next_rank is None


@pytest.mark.parametrize(
    "world_size, sizes, message",
    [
        (
            6,
            dict(tp_size=4),
            "--tensor-model-parallel-size 4 x --pipeline-model-parallel-size 1 does not divide the 6 ranks",
        ),
        (8, dict(tp_size=2, pp_size=3), "--pipeline-model-parallel-size 3 does not divide the 8 ranks"),
        (
            8,
            dict(pp_size=2, ep_size=8),
            "--moe-expert-parallel-size 8 x --expert-tensor-parallel-size 1 does not divide "
            "the 4 ranks of a pipeline stage",
        ),
        (8, dict(ep_size=2, expert_tp_size=3), "--expert-tensor-parallel-size 3 does not divide the 8 ranks"),
        (4, dict(ep_size=3), "--moe-expert-parallel-size 3 x"),
        (4, dict(tp_size=0), "--tensor-model-parallel-size 0 is not a parallel size"),
    ],
)
def test_sizes_that_do_not_tile_the_world_name_the_flag(world_size, sizes, message):
    with pytest.raises(ConfigError, match=message):
        rank_layout(world_size, **sizes)


def test_launched_world_size_checks_every_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launched_world_size() == launched_world_size(2) == launched_world_size(tp_size=2, pp_size=2) == 4
    with pytest.raises(ConfigError, match="--moe-expert-parallel-size 3"):
        launched_world_size(3)
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size 8"):
        launched_world_size(pp_size=8)


CONFIGS = {  # name -> build_parallel_grid sizes on 4 ranks
    "tp2_pp2": dict(tp_size=2, pp_size=2),
    "tp2_ep2": dict(tp_size=2, ep_size=2),
    "tp2_ep2_etp2": dict(tp_size=2, ep_size=2, expert_tp_size=2),
    "ep2": dict(ep_size=2),
}
KINDS = PARTITIONS + ("embedding",)


def _group_sums() -> dict[str, torch.Tensor]:
    """For every config and group kind: the sum of the members' ranks, this rank's place and the group size
    (-1 where this rank has no group of that kind), plus the pipeline neighbours."""
    out = {}
    for name, sizes in CONFIGS.items():
        grid = build_parallel_grid(torch.device("cpu"), **sizes)
        for kind in KINDS:
            group = getattr(grid, f"{kind}_group")
            total = torch.tensor([float(grid.rank)])
            if group is not None:
                dist.all_reduce(total, group=group)
            out[f"{name}.{kind}"] = total if group is not None else torch.tensor([-1.0])
            if kind != "embedding":
                out[f"{name}.{kind}.place"] = torch.tensor(
                    [
                        dist.get_rank(group),
                        getattr(grid, f"{kind}_rank"),
                        dist.get_world_size(group),
                        getattr(grid, f"{kind}_size"),
                    ]
                )
        out[f"{name}.neighbours"] = torch.tensor(
            [-1 if r is None else r for r in (grid.pp_prev_rank, grid.pp_next_rank)]
        )
        out[f"{name}.dp_group_is_world"] = torch.tensor(grid.dp_group is dist.group.WORLD)
    return out


def test_built_groups_reduce_over_the_expected_members():
    results = run_distributed(_group_sums, 4)
    for name, sizes in CONFIGS.items():
        layout = rank_layout(4, **sizes)
        for rank, result in enumerate(results):
            for kind in KINDS:
                members = next((ranks for ranks in getattr(layout, kind) if rank in ranks), None)
                expected = -1.0 if members is None else float(sum(members))
                assert result[f"{name}.{kind}"].item() == expected, (name, kind, rank)
                if kind != "embedding":
                    place = position_in(getattr(layout, kind), rank)
                    assert result[f"{name}.{kind}.place"].tolist() == [place, place, len(members), len(members)]
            pp_members = next(ranks for ranks in layout.pp if rank in ranks)
            stage = pp_members.index(rank)
            neighbours = [
                pp_members[stage - 1] if stage > 0 else -1,
                pp_members[stage + 1] if stage + 1 < len(pp_members) else -1,
            ]
            assert result[f"{name}.neighbours"].tolist() == neighbours, (name, rank)
            assert result[f"{name}.dp_group_is_world"].item() == (len(layout.dp) == 1), (name, rank)
    # the ep-only grid is exactly today's: dp over the world, ep = rank % 2, expert-dp = rank // 2
    assert [r["ep2.ep.place"][1].item() for r in results] == [0, 1, 0, 1]
    assert [r["ep2.expert_dp.place"][1].item() for r in results] == [0, 0, 1, 1]
    assert [r["ep2.dp.place"][1].item() for r in results] == [0, 1, 2, 3]
