"""1-bit Adam (`"type": "OneBitAdam"`): before `freeze_step` DeepSpeed's Adam update (no bias
correction) on all-reduced gradients; after it each rank's momentum of its own gradients averaged
by the 1-bit compressed all-reduce with the variance frozen, equal on 2 gloo ranks to a
single-process simulation of the same algorithm (tests/onebit_reference.py); and the
combinations DeepSpeed refuses are refused here with one sentence."""

import pytest
import torch

from megatron.errors import ConfigError
from megatron.parallel import build_parallel_grid
from megatron.runtime import initialize, load_runtime_config
from megatron.runtime.optim.onebit_adam import OneBitAdam
from tests.dist_utils import run_distributed
from tests.onebit_reference import ReferenceAveraging

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
        grads = []
        for rank, replica in enumerate(replicas):
            replica.zero_grad()
            loss_of(replica, step, rank).backward()
            grads.append({n: p.grad.clone() for n, p in replica.named_parameters()})
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
            torch.testing.assert_close(rank[name], value, rtol=1e-5, atol=1e-6, msg=name)


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
    assert optimizer.steps_taken == 3 and not optimizer.compressing


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


def _resumed(folder: str) -> dict[str, torch.Tensor]:
    grid = build_parallel_grid(torch.device("cpu"))
    engine = initialize(model(), CONFIG, grid)
    for step in range(FREEZE + 1):  # one compressed step
        engine.backward(loss_of(engine.module, step, grid.rank))
        engine.step()
    engine.save_checkpoint(folder, "after_freeze")
    momenta = [engine.optimizer.state[p]["exp_avg"].clone() for p in engine.module.parameters()]
    again = initialize(model(), CONFIG, grid)
    again.load_checkpoint(folder, "after_freeze")
    optimizer = again.optimizer
    restored = [optimizer.state[p]["exp_avg"] for p in again.module.parameters()]
    same = all(torch.equal(a, b) for a, b in zip(momenta, restored))
    return {
        "steps": torch.tensor(optimizer.steps_taken),
        "compressing": torch.tensor(optimizer.compressing),
        "momenta_restored": torch.tensor(same),
        "errors_after_load": torch.tensor(len(optimizer.errors)),
    }


def test_a_checkpoint_resumes_the_freeze_and_the_momenta_and_starts_the_errors_at_zero(tmp_path):
    for rank in run_distributed(_resumed, RANKS, str(tmp_path)):
        assert int(rank["steps"]) == FREEZE + 1 and bool(rank["compressing"]) and bool(rank["momenta_restored"])
        assert int(rank["errors_after_load"]) == 0  # DeepSpeed resets them on load too
