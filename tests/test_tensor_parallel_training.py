"""Training under tensor parallelism equals training on one process: 10 iterations of the Trainer
at TP=2 (with and without sequence parallelism, ZeRO 0, 1 and 3) and at TP=2 x DP=2, against the
single-process run, losses to 1e-5 relative and the whole parameters after the steps. Checkpoints
move between the layouts: saved at iteration 5 under one (TP, DP, ZeRO stage) and resumed under
another, the run ends where the uninterrupted one does, optimizer state included."""

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.errors import ConfigError
from megatron.parallel import build_parallel_grid, single_process_grid
from megatron.placement import expert_ids, tensor_parallel_split
from megatron.training.loop import Trainer
from tests.dist_utils import Results, layout_spawns
from tests.training_fixtures import MODERN_MOE, tiny_config, write_corpus

ARCHITECTURES = {
    "classic": {},
    "modern": {
        "swiglu": True,
        "disable_bias_linear": True,
        "normalization": "RMSNorm",
        "group_query_attention": True,
        "num_query_groups": 2,
        "position_embedding_type": "rope",
        "untie_embeddings_and_output_weights": True,
    },
    # dropless and without DeepSpeed's random second expert: capacity counts each rank's tokens under
    # sequence parallelism (as in Megatron-Core) and each rank draws its own noise, so only then is
    # the routing that of one process
    "moe": {
        "num_experts": 4,
        "topk": 2,
        "disable_moe_token_dropping": True,
        "moe_z_loss_coeff": 1e-2,
        "disable_moe_top2_2nd_expert_sampling": True,
    },
    "modern_moe": {
        **MODERN_MOE,
        "disable_moe_token_dropping": True,
        "moe_router_load_balancing_type": "seq_aux_loss",
        "moe_router_bias_update_rate": 1e-2,
    },
}
# the padded vocabulary (61 -> 64) is a multiple of 32 x TP, so TP=1 and TP=2 build the same model
COMMON = dict(
    train_iters=10,
    micro_batch_size=2,
    global_batch_size=4,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    make_vocab_size_divisible_by=32,
    clip_grad=0.05,
    eval_interval=100,
)


def _gathered(value: torch.Tensor, group: dist.ProcessGroup, size: int) -> list[torch.Tensor]:
    pieces = [torch.empty_like(value) for _ in range(size)]
    dist.all_gather(pieces, value, group=group)
    return pieces


def _whole_parameters(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter as one process holds it: tensor-parallel slices gathered from the TP group,
    experts from the expert-parallel group."""
    grid, out = trainer.grid, {}
    with trainer.engine.whole_parameters():
        for name, param in trainer.engine.module.named_parameters():
            value, split = param.detach().clone(), tensor_parallel_split(param)
            if split is not None:  # over the tensor-parallel group, or the experts' own
                value = split.whole_of(value)
            if expert_ids(param) is not None and grid.ep_size > 1:  # consecutive ids on consecutive EP ranks
                value = torch.cat(_gathered(value, grid.ep_group, grid.ep_size))
            out[name] = value
    return out


def _train(corpus: str, dp_size: int, grid, **flags: object) -> dict[str, torch.Tensor]:
    config = tiny_config(corpus, dp_size=dp_size, **COMMON, **flags)
    trainer = Trainer(config, grid)
    losses = torch.tensor(trainer.train().losses, dtype=torch.float64)
    return {"losses": losses, **_whole_parameters(trainer)}


def _runs(world: int, folder: str) -> list[tuple[str, dict[str, object]]]:
    """(key, flags) of each run; TP=2 unless the flags say otherwise."""
    if world == 4:  # TP=2 x DP=2, and with MoE EP=2 inside it, with whole or split (expert-TP=2) experts
        return [
            (f"modern/sp1/zero{stage}", {**ARCHITECTURES["modern"], "sequence_parallel": True, "zero_stage": stage})
            for stage in (1, 3)
        ] + [
            (
                f"{arch}/ep2{etp_key}/zero{stage}",
                {
                    **ARCHITECTURES[arch],
                    "sequence_parallel": True,
                    "zero_stage": stage,
                    "moe_expert_parallel_size": 2,
                    **etp,
                },
            )
            for arch, stage in (("moe", 1), ("modern_moe", 3))
            for etp_key, etp in (("", {}), ("_etp2", ETP2))
        ]
    dense = [
        (f"{arch}/sp{int(sp)}/zero{stage}", {**ARCHITECTURES[arch], "sequence_parallel": sp, "zero_stage": stage})
        for arch in ("classic", "modern")
        for sp in (False, True)
        for stage in (0, 1, 3)
    ]
    # MoE under tensor parallelism needs sequence parallelism; experts whole on both ranks (EP=1) or split (EP=2)
    moe = [
        (
            f"{arch}/ep{ep}/zero{stage}",
            {**ARCHITECTURES[arch], "sequence_parallel": True, "zero_stage": stage, "moe_expert_parallel_size": ep},
        )
        for arch in ("moe", "modern_moe")
        for ep, stage in ((1, 0), (2, 1), (2, 3))
    ]
    # experts split over expert-TP=2: the dense layers' TP group (TP=2), or two data-parallel ranks (TP=1)
    expert_tp = [
        ("moe/etp2/zero0", {**ARCHITECTURES["moe"], "sequence_parallel": True, "zero_stage": 0, **ETP2}),
        ("modern_moe/etp2/zero3", {**ARCHITECTURES["modern_moe"], "sequence_parallel": True, "zero_stage": 3, **ETP2}),
        ("moe/tp1_etp2/zero1", {**ARCHITECTURES["moe"], "zero_stage": 1, **TP1_ETP2}),
    ]
    offloaded = [
        ("modern/offload_nvme", {**MODERN_SP, **offload(folder, "nvme")}),
        (
            "moe/offload_cpu",
            {
                **ARCHITECTURES["moe"],
                "sequence_parallel": True,
                "moe_expert_parallel_size": 2,
                **offload(folder, "cpu"),
            },
        ),
    ]
    return dense + moe + expert_tp + offloaded


MODERN_SP = {**ARCHITECTURES["modern"], "sequence_parallel": True}
ETP2 = {"expert_tensor_parallel_size": 2}
TP1_ETP2 = {"tensor_model_parallel_size": 1, **ETP2}
# the expert-TP checkpoints: saved under this layout for one process, and one process's resumed under it
EXPERT_TP_LAYOUTS = {
    2: ({**ARCHITECTURES["modern_moe"], **TP1_ETP2}, 1, 3),  # flags, ZeRO stage saved, ZeRO stage resumed
    4: ({**ARCHITECTURES["modern_moe"], "sequence_parallel": True, "moe_expert_parallel_size": 2, **ETP2}, 3, 1),
}
OFFLOADS = {  # optimizer offload to the CPU at stage 1; optimizer and parameters in NVMe swap files at stage 3
    "cpu": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
    "nvme": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "SWAP"},
        "offload_param": {"device": "nvme", "nvme_path": "SWAP", "max_in_cpu": 0},
    },
}


def write_offload_configs(folder: str) -> None:
    for kind, zero in OFFLOADS.items():
        text = json.dumps({"zero_optimization": zero}).replace("SWAP", f"{folder}/swap")
        (Path(folder) / f"offload_{kind}.json").write_text(text)


def offload(folder: str, kind: str) -> dict[str, object]:
    """The flags of a run with `OFFLOADS[kind]` (the files write_offload_configs wrote)."""
    return {"deepspeed": True, "deepspeed_config": f"{folder}/offload_{kind}.json"}


def _train_in_layout(corpus: str, **flags: object) -> dict[str, torch.Tensor]:
    """A run in the layout its flags ask for (TP=2 unless they say otherwise)."""
    flags = {"tensor_model_parallel_size": 2, **flags}
    grid = build_parallel_grid(
        torch.device("cpu"),
        tp_size=int(flags["tensor_model_parallel_size"]),
        ep_size=int(flags.get("moe_expert_parallel_size", 1)),
        expert_tp_size=int(flags.get("expert_tensor_parallel_size", 1)),
    )
    return _train(corpus, grid.dp_size, grid, **flags)


def _on_rank(corpus: str, folder: str, layouts: list[str], checkpoints: bool) -> dict[str, torch.Tensor]:
    """Each of `layouts` (keys of _runs) trained; with `checkpoints`, the checkpoints moved between
    this layout and one process's."""
    world = dist.get_world_size()
    out = {}
    for key, flags in _runs(world, folder):
        if key in layouts:
            out.update({f"{key}/{name}": value for name, value in _train_in_layout(corpus, **flags).items()})
    if not checkpoints:
        return out
    # a checkpoint of this layout for the single process, and resumes of the single process's
    grid = build_parallel_grid(torch.device("cpu"), tp_size=2)
    stage = 1 if world == 2 else 3
    _train(
        corpus,
        grid.dp_size,
        grid,
        tensor_model_parallel_size=2,
        zero_stage=stage,
        save=f"{folder}/tp2_w{world}",
        save_interval=5,
        **MODERN_SP,
    )
    for resumed_stage in (0, 3):
        result = _train(
            corpus,
            grid.dp_size,
            grid,
            tensor_model_parallel_size=2,
            zero_stage=resumed_stage,
            load=f"{folder}/serial",
            ckpt_step=5,
            **MODERN_SP,
        )
        out.update({f"resumed{resumed_stage}/{name}": value for name, value in result.items()})
    flags, saved_stage, resumed_stage = EXPERT_TP_LAYOUTS[world]
    _train_in_layout(corpus, zero_stage=saved_stage, save=f"{folder}/etp2_w{world}", save_interval=5, **flags)
    result = _train_in_layout(corpus, zero_stage=resumed_stage, load=f"{folder}/serial_moe", ckpt_step=5, **flags)
    out.update({f"moe_resumed/{name}": value for name, value in result.items()})
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("tp_corpus"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tp_checkpoints"))
    write_offload_configs(path)
    return path


@pytest.fixture(scope="module")
def serial(corpus, folder) -> dict[str, dict[str, torch.Tensor]]:
    grid = single_process_grid(torch.device("cpu"))
    # the modern runs save at iteration 5 for the tensor-parallel resumes
    saved = {"modern": f"{folder}/serial", "modern_moe": f"{folder}/serial_moe"}
    return {
        arch: _train(corpus, 1, grid, **flags, **({"save": saved[arch], "save_interval": 5} if arch in saved else {}))
        for arch, flags in ARCHITECTURES.items()
    }


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str = "") -> None:
    """Parameters equal (round-off of sums in another order), and the losses of the iterations both ran."""
    torch.testing.assert_close(
        got["losses"],
        want["losses"][len(want["losses"]) - len(got["losses"]) :],
        rtol=1e-5,
        atol=0,
        msg=f"{what}losses",
    )
    for name, value in want.items():
        if name != "losses":
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=2e-6, msg=f"{what}{name}")


@pytest.fixture(scope="module")
def distributed(request, corpus, folder, serial) -> Callable[[int], Results]:
    """Every rank's results of one spawn per world size (after `serial`, whose checkpoints it resumes)."""
    return layout_spawns(request, _on_rank, corpus, folder)


def _averaged(results: Results, prefix: str) -> dict[str, torch.Tensor]:
    """Rank 0's whole parameters under `prefix`, with the losses of the data-parallel shares averaged."""
    out = {name[len(prefix) :]: value for name, value in results[0].items() if name.startswith(prefix)}
    out["losses"] = torch.stack([result[f"{prefix}losses"] for result in results]).mean(0)
    return out


LAYOUTS = [(world, key) for world in (2, 4) for key, _ in _runs(world, "")]


@pytest.mark.parametrize("world, layout", LAYOUTS, ids=[f"w{world}-{key}" for world, key in LAYOUTS])
def test_a_tensor_parallel_layout_trains_as_one_process(distributed, serial, world: int, layout: str) -> None:
    results = distributed(world)
    want = serial[layout.split("/")[0]]
    assert len(want["losses"]) == 10
    # each rank's loss is over its data-parallel share of the batch; the shares average to the whole
    losses = torch.stack([result[f"{layout}/losses"] for result in results]).mean(0)
    torch.testing.assert_close(losses, want["losses"], rtol=1e-5, atol=0, msg=f"{layout}/losses")
    for rank, result in enumerate(results):
        for name, value in want.items():
            if name != "losses":  # the split GEMMs and the vocabulary-parallel loss sum in another order
                torch.testing.assert_close(
                    result[f"{layout}/{name}"], value, rtol=1e-5, atol=2e-6, msg=f"rank {rank} {layout}/{name}"
                )


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [0, 3])
def test_one_processs_checkpoint_resumes_under_tensor_parallelism(distributed, serial, world: int, stage: int) -> None:
    resumed = _averaged(distributed(world), f"resumed{stage}/")
    assert len(resumed["losses"]) == 5
    assert_same(resumed, serial["modern"], f"TP=2 x DP={world // 2} resumed at stage {stage} from one process: ")


def _resumed_on_one_process(corpus: str, saved: str, stage: int, architecture: str) -> dict[str, torch.Tensor]:
    """Training resumed on one process at ZeRO `stage` from the multi-rank checkpoint in `saved`."""
    grid = single_process_grid(torch.device("cpu"))
    return _train(corpus, 1, grid, zero_stage=stage, load=saved, ckpt_step=5, **ARCHITECTURES[architecture])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_tensor_parallel_checkpoint_resumes_on_one_process(
    distributed, serial, corpus, folder, world: int, stage: int
) -> None:
    distributed(world)  # saves it
    resumed = _resumed_on_one_process(corpus, f"{folder}/tp2_w{world}", stage, "modern")
    assert_same(resumed, serial["modern"], f"one process at stage {stage} resumed from TP=2 x DP={world // 2}: ")


@pytest.mark.parametrize("world", [2, 4])
def test_one_processs_moe_checkpoint_resumes_under_expert_tensor_parallelism(distributed, serial, world: int) -> None:
    resumed = _averaged(distributed(world), "moe_resumed/")
    assert_same(resumed, serial["modern_moe"], f"expert-TP=2 on {world} ranks resumed from one process: ")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [0, 3])
def test_an_expert_tensor_parallel_checkpoint_resumes_on_one_process(
    distributed, serial, corpus, folder, world: int, stage: int
) -> None:
    distributed(world)  # saves it
    resumed = _resumed_on_one_process(corpus, f"{folder}/etp2_w{world}", stage, "modern_moe")
    assert_same(
        resumed, serial["modern_moe"], f"one process at stage {stage} resumed from expert-TP=2 on {world} ranks: "
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"sequence_parallel": True}, "--sequence-parallel splits the activations between tensor-parallel regions"),
    ],
)
def test_what_tensor_parallelism_does_not_cover_yet_stops_with_one_sentence(corpus, flags, message) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_config(corpus, **flags)
