"""1-bit Adam (`"type": "OneBitAdam"`): before `freeze_step` DeepSpeed's Adam update (no bias
correction) on all-reduced gradients; after it each rank's momentum of its own gradients averaged
by the 1-bit compressed all-reduce with the variance frozen, equal on 2 gloo ranks to a
single-process simulation of the same algorithm (tests/onebit_reference.py); a resume
while compressing is exact (error feedback included) and re-splits the errors at another
data-parallel size; bf16/fp16, overflow skips and gradient accumulation work under it; and the
combinations DeepSpeed refuses are refused here with one sentence."""

import json

import pytest
import torch

from megatron.config.flags import parse_args
from megatron.errors import ConfigError
from megatron.parallel import build_parallel_grid
from megatron.runtime import initialize, load_runtime_config
from megatron.runtime.engine import Engine
from megatron.runtime.optim.compressed import CompressedOptimizer
from megatron.runtime.optim.onebit_adam import OneBitAdam
from megatron.training.loop import Trainer
from tests.dist_utils import run_distributed
from tests.onebit_reference import ReferenceAveraging
from tests.test_zero import Net
from tests.training_fixtures import tiny_flags, with_data_parallel_size, write_corpus

LR, BETAS, EPS, WD, FREEZE, STEPS, RANKS = 0.01, (0.9, 0.99), 1e-8, 0.01, 2, 6, 2


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def loss_of(net: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank)
    return ((net(x) - y) ** 2).mean()


def replica_gradients(replicas: list[torch.nn.Module], step: int) -> list[dict[str, torch.Tensor]]:
    """Each simulated rank's own gradients at step `step` (0-based), by parameter name."""
    grads = []
    for rank, replica in enumerate(replicas):
        replica.zero_grad()
        loss_of(replica, step, rank).backward()
        grads.append({n: p.grad.clone() for n, p in replica.named_parameters()})
    return grads


CONFIG = {
    "train_batch_size": 4 * RANKS,
    "optimizer": {
        "type": "OneBitAdam",
        "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD, "freeze_step": FREEZE},
    },
}


def _trained() -> dict[str, torch.Tensor]:
    grid = build_parallel_grid(torch.device("cpu"))
    engine = initialize(model(), CONFIG, grid)
    assert isinstance(engine.optimizer, OneBitAdam)
    for step in range(STEPS):
        engine.backward(loss_of(engine.module, step, grid.rank))
        engine.step()
    return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def simulated() -> dict[str, torch.Tensor]:
    """The algorithm in one process: a replica per rank, each its own gradients; the shared Adam
    state; after the warm-up each rank's momentum averaged by the reference compression."""
    replicas = [model() for _ in range(RANKS)]
    params = [dict(r.named_parameters()) for r in replicas]
    names = list(params[0])
    m = {n: torch.zeros_like(params[0][n]) for n in names}
    v = {n: torch.zeros_like(params[0][n]) for n in names}
    averaging = {n: ReferenceAveraging(-(-params[0][n].numel() // (8 * RANKS)) * 8 * RANKS, RANKS) for n in names}
    for step in range(STEPS):
        grads = replica_gradients(replicas, step)
        for n in names:
            if step < FREEZE:  # all-reduced gradients, Adam without bias correction
                g = sum(gr[n] for gr in grads) / RANKS
                m[n] = BETAS[0] * m[n] + (1 - BETAS[0]) * g
                v[n] = BETAS[1] * v[n] + (1 - BETAS[1]) * g * g
            else:
                numel = m[n].numel()
                padded = averaging[n].chunk * RANKS
                local = [torch.cat([(BETAS[0] * m[n] + (1 - BETAS[0]) * gr[n]).reshape(-1), torch.zeros(padded - numel)])
                         for gr in grads]  # fmt: skip
                m[n] = averaging[n](local)[:numel].view_as(m[n])
            decay = WD if m[n].dim() >= 2 else 0.0  # the toolkit's groups: matrices decayed, biases not
            with torch.no_grad():
                for p in params:
                    p[n] -= LR * (m[n] / (v[n].sqrt() + EPS) + decay * p[n])
    return {n: params[0][n].detach() for n in names}


def test_two_ranks_equal_the_algorithm_simulated_in_one_process():
    expected = simulated()
    for rank in run_distributed(_trained, RANKS):
        for name, value in expected.items():
            torch.testing.assert_close(rank[name], value, rtol=1e-5, atol=1e-6)


def test_the_warm_up_is_deepspeeds_adam_without_bias_correction():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    optimizer = OneBitAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, freeze_step=10)
    m = v = torch.zeros(3)
    expected = p.detach().clone()
    for step in range(3):
        g = torch.tensor([0.1, -0.3, 0.2]) * (step + 1)
        p.grad = g.clone()
        optimizer.step()
        m, v = BETAS[0] * m + (1 - BETAS[0]) * g, BETAS[1] * v + (1 - BETAS[1]) * g * g
        expected -= LR * (m / (v.sqrt() + EPS) + WD * expected)
    torch.testing.assert_close(p.detach(), expected)
    assert optimizer.steps_taken == 3 and optimizer.reduces_gradients


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"zero_optimization": {"stage": 1}}, "OneBitAdam compresses whole momenta, which ZeRO stage 1 partitions"),
        ({"prescale_gradients": True}, "OneBitAdam averages its momenta over data parallelism; drop prescale"),
        ({"optimizer": {"type": "OneBitAdam", "params": {"max_coeff": 0.3}}}, "max_coeff is not a parameter of OneBitAdam"),
        ({"optimizer": {"type": "Adam", "params": {"freeze_step": 10}}}, "freeze_step is not a parameter of Adam"),
    ],
)  # fmt: skip
def test_what_deepspeed_refuses_with_it_is_refused_by_name(changes, message):
    with pytest.raises(ConfigError, match=message):
        load_runtime_config({**CONFIG, **changes}, RANKS)


def config(ranks: int, **changes: object) -> dict:
    return {**CONFIG, "train_batch_size": 4 * ranks, **changes}


def steps(engine: Engine, first: int, last: int, corrupt: int | None = None) -> None:
    """Steps first..last-1; at step `corrupt` the first rank's loss is made infinite."""
    rank = engine.parallel.rank
    for step in range(first, last):
        loss = loss_of(engine.module, step, rank)
        engine.backward(loss * float("inf") if step == corrupt and rank == 0 else loss)
        engine.step()


def parameters(engine: Engine, label: str) -> dict[str, torch.Tensor]:
    return {f"{label}/{name}": p.detach().clone() for name, p in engine.module.named_parameters()}


def errors(engine: Engine, label: str = "errors") -> dict[str, torch.Tensor]:
    out = {}
    for name, param in engine.module.named_parameters():
        if param in engine.optimizer.errors:
            feedback = engine.optimizer.errors[param]
            out[f"{label}/worker/{name}"], out[f"{label}/server/{name}"] = (
                feedback.worker.clone(),
                feedback.server.clone(),
            )
    return out


def _straight_and_resumed(folder: str) -> dict[str, torch.Tensor]:
    grid = build_parallel_grid(torch.device("cpu"))
    straight = initialize(model(), CONFIG, grid)
    steps(straight, 0, STEPS)
    first = initialize(model(), CONFIG, grid)
    steps(first, 0, FREEZE + 2)  # two compressed steps: errors and momenta that differ per rank
    first.save_checkpoint(folder, "compressing")
    again = initialize(model(), CONFIG, grid)
    again.load_checkpoint(folder, "compressing")
    loaded = errors(again)
    steps(again, FREEZE + 2, STEPS)
    return {**parameters(straight, "straight"), **parameters(again, "resumed"), **loaded, **errors(first, "saved")}


def test_a_resume_while_compressing_continues_bit_exactly_errors_included(tmp_path):
    for rank in run_distributed(_straight_and_resumed, RANKS, str(tmp_path)):
        saved = {name: v for name, v in rank.items() if name.startswith("saved/")}
        assert saved and all(torch.equal(v, rank[name.replace("saved/", "errors/")]) for name, v in saved.items())
        for name in (n for n in rank if n.startswith("straight/")):
            assert torch.equal(rank[name], rank[name.replace("straight/", "resumed/")]), name


def _saved_at_four(folder: str) -> dict[str, torch.Tensor]:
    engine = initialize(model(), config(4), build_parallel_grid(torch.device("cpu")))
    steps(engine, 0, FREEZE + 2)
    engine.save_checkpoint(folder, "dp4")
    return errors(engine)


def _loaded_at_two(folder: str) -> dict[str, torch.Tensor]:
    engine = initialize(model(), config(2), build_parallel_grid(torch.device("cpu")))
    engine.load_checkpoint(folder, "dp4")
    loaded = errors(engine)
    steps(engine, FREEZE + 2, STEPS)
    finite = all(bool(torch.isfinite(p).all()) for p in engine.module.parameters())
    return {**loaded, "finite": torch.tensor(finite), "steps": torch.tensor(engine.optimizer.steps_taken)}


def test_errors_saved_at_four_ranks_are_re_split_for_two(tmp_path, capfd):
    four = run_distributed(_saved_at_four, 4, str(tmp_path))
    two = run_distributed(_loaded_at_two, 2, str(tmp_path))
    assert "error feedback re-split for replica groups of another size (4 -> 2)" in capfd.readouterr().out
    for name, param in model().named_parameters():
        numel = param.numel()
        mean_worker = torch.stack([rank[f"errors/worker/{name}"][:numel] for rank in four]).mean(0)
        joined_server = torch.cat([rank[f"errors/server/{name}"] for rank in four])[:numel]
        for rank in two:  # each rank: the saved ranks' mean worker error, zero padding
            worker = rank[f"errors/worker/{name}"]
            torch.testing.assert_close(worker[:numel], mean_worker, rtol=0, atol=0)
            assert not worker[numel:].any() and worker.numel() % 16 == 0
        torch.testing.assert_close(torch.cat([rank[f"errors/server/{name}"] for rank in two])[:numel], joined_server)
    assert all(bool(rank["finite"]) and int(rank["steps"]) == STEPS for rank in two)


def _bf16_or_fp16(precision: str) -> dict[str, torch.Tensor]:
    grid = build_parallel_grid(torch.device("cpu"))
    precisions = {
        "bf16": {"bf16": {"enabled": True}},
        "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}},
    }
    engine = initialize(model(), config(RANKS, **precisions[precision]), grid)
    start = parameters(engine, "start")
    steps(engine, 0, FREEZE + 1)
    before = {**parameters(engine, "before"), **errors(engine, "before")}
    scale = engine.loss_scaler.scale
    steps(engine, FREEZE + 1, FREEZE + 2, corrupt=FREEZE + 1)  # one rank's overflow while compressing
    skipped = {**parameters(engine, "skipped"), **errors(engine, "skipped")}
    scale_ratio = engine.loss_scaler.scale / scale if precision == "fp16" else 0.5  # bf16 has no loss scale
    steps(engine, FREEZE + 2, STEPS)
    return {
        **start, **before, **skipped, **parameters(engine, "end"),
        "scale_ratio": torch.tensor(scale_ratio),
        "skipped_steps": torch.tensor(engine.skipped_steps),
    }  # fmt: skip


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_under_bf16_and_fp16_replicas_stay_equal_and_an_overflow_skips_on_every_rank(precision):
    ranks = run_distributed(_bf16_or_fp16, RANKS, precision)
    for name in (n for n in ranks[0] if n.startswith("end/")):
        assert torch.equal(ranks[0][name], ranks[1][name]), name  # the compressed mean is the same everywhere
        assert not torch.equal(ranks[0][name], ranks[0][name.replace("end/", "start/")])
    for rank in ranks:  # the skipped step changed nothing: parameters and errors as before it
        assert int(rank["skipped_steps"]) == 1 and float(rank["scale_ratio"]) == 0.5
        for name in (n for n in rank if n.startswith("before/")):
            assert torch.equal(rank[name], rank[name.replace("before/", "skipped/")]), name


def _accumulated(micro_batches: int) -> dict[str, torch.Tensor]:
    """Each rank's 4 rows of a step as one micro-batch, or as `micro_batches` accumulated."""
    grid = build_parallel_grid(torch.device("cpu"))
    engine = initialize(model(), config(RANKS, train_micro_batch_size_per_gpu=4 // micro_batches), grid)
    rows = 4 // micro_batches
    for step in range(STEPS):
        x, y = batch(step, grid.rank)
        for micro in range(micro_batches):
            part = slice(micro * rows, (micro + 1) * rows)
            engine.backward(((engine(x[part]) - y[part]) ** 2).mean())
            engine.step()
    return parameters(engine, "p")


def test_gradient_accumulation_equals_one_micro_batch_of_the_same_rows():
    whole, accumulated = run_distributed(_accumulated, RANKS, 1), run_distributed(_accumulated, RANKS, 2)
    for one, two in zip(whole, accumulated):
        for name, value in one.items():
            torch.testing.assert_close(two[name], value, rtol=1e-5, atol=1e-6)


def _expert_parallel_first_compressed_step() -> dict[str, torch.Tensor]:
    """4 ranks, EP=2: dense parameters have 4 replicas, each expert 2 (its expert-data-parallel
    group). At the first compressed step each rank's momentum of its own gradients goes into the
    compressed mean; the mean of those over the replicas must be the momentum plain Adam would
    have made from the reduced gradients."""
    grid = build_parallel_grid(torch.device("cpu"), ep_size=2)
    optimizer = {"type": "OneBitAdam", "params": {"lr": 0.01, "freeze_step": 1, "betas": list(BETAS)}}
    engine = initialize(Net(True, grid.ep_group), {"train_batch_size": 8, "optimizer": optimizer}, grid)
    sent: dict[torch.Tensor, torch.Tensor] = {}
    averaged = CompressedOptimizer.compressed_mean

    def recording(self: CompressedOptimizer, key: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        sent[key] = flat.clone()
        return averaged(self, key, flat)

    CompressedOptimizer.compressed_mean = recording
    out = {}
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, y = (
            torch.randn(8, 3, 15, generator=g)[2 * grid.rank :][:2],
            torch.randn(8, 3, 1, generator=g)[2 * grid.rank :][:2],
        )
        engine.backward(((engine(x) - y) ** 2).mean())
        if step == 1:
            for name, param in engine.module.named_parameters():
                group = engine.optimizer.replica_group(param)
                reduced = param.grad.clone()
                torch.distributed.all_reduce(reduced, group=group)
                momentum = engine.optimizer.state[param]["exp_avg"]
                out[f"expected/{name}"] = BETAS[0] * momentum + (1 - BETAS[0]) * reduced / grid.dp_size
                out[f"replicas/{name}"] = torch.tensor(torch.distributed.get_world_size(group))
        engine.step()
    for name, param in engine.module.named_parameters():
        group = engine.optimizer.replica_group(param)
        mean = sent[param].clone()
        torch.distributed.all_reduce(mean, group=group)
        out[f"sent_mean/{name}"] = (mean / torch.distributed.get_world_size(group)).view_as(param)
    return out


def test_under_expert_parallelism_experts_average_over_their_replicas_and_dense_over_all():
    for rank in run_distributed(_expert_parallel_first_compressed_step, 4):
        names = [n.removeprefix("expected/") for n in rank if n.startswith("expected/")]
        assert {int(rank[f"replicas/{n}"]) for n in names} == {2, 4}  # experts' groups and the dense one
        for name in names:
            torch.testing.assert_close(rank[f"sent_mean/{name}"], rank[f"expected/{name}"])


def _trainer_replicas(corpus: str, ds_config: str) -> dict[str, torch.Tensor]:
    flags = tiny_flags(corpus, train_iters=5, eval_interval=100, hidden_dropout=0.0, attention_dropout=0.0)
    config = with_data_parallel_size(parse_args(flags + ["--deepspeed", "--deepspeed_config", ds_config]), RANKS)
    trainer = Trainer(config, build_parallel_grid(torch.device("cpu")))
    trainer.train()
    return parameters(trainer.engine, "p")


@pytest.mark.parametrize("kind", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_a_training_run_keeps_the_replicas_equal(tmp_path, kind):
    """The trainer hands its optimizer the grid: without it each rank would step alone. 0/1 Adam's
    synchronisations land every replica on the same bits (undoing the local steps by subtraction
    parted them by 2**-16 on the key bias, whose variance is near zero)."""
    params = {"OneBitAdam": {"freeze_step": 2}, "ZeroOneAdam": {"var_freeze_step": 2}, "OneBitLamb": {"freeze_step": 2}}
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps({"optimizer": {"type": kind, "params": {"lr": 3e-3, **params[kind]}}}))
    first, second = run_distributed(_trainer_replicas, RANKS, write_corpus(tmp_path), str(ds_config))
    for name, value in first.items():
        assert torch.equal(value, second[name]), name
