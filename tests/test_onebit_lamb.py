"""1-bit LAMB (`"type": "OneBitLamb"`): on 2 gloo ranks equal to the algorithm written out for
simulated replicas in one process (LAMB on all-reduced gradients with a running average of the
trust ratios; then every momentum scaled to a common RMS, all averaged as one buffer by the 1-bit
compressed all-reduce, and the frozen trust ratio times the clamped factor of frozen to fresh
variance); a resume while compressing is bit-exact; and bad combinations are refused by name."""

import pytest
import torch

from megatron.errors import ConfigError
from megatron.parallel import build_parallel_grid
from megatron.runtime import initialize, load_runtime_config
from megatron.runtime.optim.onebit_lamb import OneBitLamb
from tests.dist_utils import run_distributed
from tests.onebit_reference import ReferenceAveraging
from tests.test_onebit_adam import BETAS, EPS, LR, WD, errors, model, parameters, replica_gradients, steps

RANKS, STEPS, FREEZE = 2, 7, 3
LAMB = {"max_coeff": 10.0, "min_coeff": 0.01, "coeff_beta": 0.9, "factor_max": 4.0, "factor_min": 0.5}
THRESHOLD = 0.1


def config(ranks: int = RANKS, **changes: object) -> dict:
    params = {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD, "freeze_step": FREEZE, **LAMB}
    optimizer = {"type": "OneBitLamb", "params": {**params, "factor_threshold": THRESHOLD}}
    return {"train_batch_size": 4 * ranks, "optimizer": optimizer, **changes}


def _trained() -> dict[str, torch.Tensor]:
    engine = initialize(model(), config(), build_parallel_grid(torch.device("cpu")))
    assert isinstance(engine.optimizer, OneBitLamb)
    steps(engine, 0, STEPS)
    coeffs = torch.tensor(engine.optimizer.get_lamb_coeffs())
    return {**parameters(engine, "p"), "coeffs": coeffs}


def trust(p: torch.Tensor, update: torch.Tensor) -> float:
    w, u = float(p.norm()), float(update.norm())
    return min(max(w / u, LAMB["min_coeff"]), LAMB["max_coeff"]) if w > 0 and u > 0 else 1.0


def simulated() -> dict[str, torch.Tensor]:
    replicas = [model() for _ in range(RANKS)]
    params = [dict(r.named_parameters()) for r in replicas]
    # the toolkit's groups: matrices (decayed) first, then biases; the buffer joins them in that order
    names = [n for n in params[0] if params[0][n].dim() >= 2] + [n for n in params[0] if params[0][n].dim() < 2]
    sizes = [params[0][n].numel() for n in names]
    padded = -(-sum(sizes) // (8 * RANKS)) * 8 * RANKS
    averaging = ReferenceAveraging(padded, RANKS)
    zeros = lambda: {n: torch.zeros_like(params[0][n]) for n in names}  # noqa: E731
    m, v, fresh = zeros(), zeros(), zeros()
    frozen_coeff, last_factor, scaling = dict.fromkeys(names, 0.0), dict.fromkeys(names, 1.0), {}
    coeffs = []
    for step in range(1, STEPS + 1):
        grads = replica_gradients(replicas, step - 1)
        coeffs = []
        with torch.no_grad():
            if step <= FREEZE:
                for n in names:
                    g = sum(gr[n] for gr in grads) / RANKS
                    m[n] = BETAS[0] * m[n] + (1 - BETAS[0]) * g
                    v[n] = BETAS[1] * v[n] + (1 - BETAS[1]) * g * g
                    if step == FREEZE:
                        fresh[n] = v[n].clone()
                    decay = WD if params[0][n].dim() >= 2 else 0.0
                    update = m[n] / (v[n].sqrt() + EPS) + decay * params[0][n]
                    c = trust(params[0][n], update)
                    if c != 1.0:
                        frozen_coeff[n] = LAMB["coeff_beta"] * frozen_coeff[n] + (1 - LAMB["coeff_beta"]) * c
                    coeffs.append(c)
                    for p in params:
                        p[n] -= LR * c * update
                continue
            if not scaling:
                rms = {n: float(m[n].norm()) / m[n].numel() ** 0.5 for n in names}
                scaling = {n: sum(rms.values()) / len(rms) / rms[n] for n in names}
            local = [
                torch.cat([((BETAS[0] * m[n] + (1 - BETAS[0]) * gr[n]) * scaling[n]).reshape(-1) for n in names])
                for gr in grads
            ]
            averaged = averaging([torch.cat([x, torch.zeros(padded - x.numel())]) for x in local])[: sum(sizes)]
            for n, piece in zip(names, averaged.split(sizes)):
                last = m[n]
                m[n] = piece.view_as(last) / scaling[n]
                rebuilt = (m[n] - BETAS[0] * last) / (1 - BETAS[0])
                fresh[n] = BETAS[1] * fresh[n] + (1 - BETAS[1]) * rebuilt * rebuilt
                denominator = v[n].sqrt() + EPS
                plain = m[n] / denominator
                decay = WD if params[0][n].dim() >= 2 else 0.0
                update = plain + decay * params[0][n]
                factor = float((denominator / (fresh[n].sqrt() + EPS)).max())
                if decay:
                    ratio = min(1.0, float(plain.norm() / update.norm()))
                    factor = factor * ratio + 1.0 - ratio
                factor = min(max(factor, LAMB["factor_min"]), LAMB["factor_max"])
                factor = min(max(factor, last_factor[n] * (1 - THRESHOLD)), last_factor[n] * (1 + THRESHOLD))
                last_factor[n] = factor
                coeffs.append(frozen_coeff[n] * factor)
                for p in params:
                    p[n] -= LR * frozen_coeff[n] * factor * update
    return {**{f"p/{n}": params[0][n].detach() for n in names}, "coeffs": torch.tensor(coeffs)}


def test_two_ranks_equal_the_algorithm_simulated_in_one_process():
    expected = simulated()
    for rank in run_distributed(_trained, RANKS):
        for name, value in expected.items():
            torch.testing.assert_close(rank[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _straight_and_resumed(folder: str) -> dict[str, torch.Tensor]:
    grid = build_parallel_grid(torch.device("cpu"))
    straight = initialize(model(), config(), grid)
    steps(straight, 0, STEPS)
    first = initialize(model(), config(), grid)
    steps(first, 0, FREEZE + 2)
    first.save_checkpoint(folder, "compressing")
    again = initialize(model(), config(), grid)
    again.load_checkpoint(folder, "compressing")
    loaded = errors(again)
    steps(again, FREEZE + 2, STEPS)
    return {**parameters(straight, "straight"), **parameters(again, "resumed"), **loaded}


def test_a_resume_while_compressing_is_bit_exact(tmp_path):
    for rank in run_distributed(_straight_and_resumed, RANKS, str(tmp_path)):
        assert any(name.startswith("errors/worker/") for name in rank)  # one buffer's errors, restored
        for name in (n for n in rank if n.startswith("straight/")):
            assert torch.equal(rank[name], rank[name.replace("straight/", "resumed/")]), name


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"zero_optimization": {"stage": 2}}, "OneBitLamb compresses whole momenta, which ZeRO stage 2 partitions"),
        ({"gradient_predivide_factor": 2.0}, "OneBitLamb averages its momenta over data parallelism"),
    ],
)
def test_what_deepspeed_refuses_with_it_is_refused_by_name(changes, message):
    with pytest.raises(ConfigError, match=message):
        load_runtime_config(config(**changes), RANKS)


def test_parameters_of_another_optimizer_are_refused_by_name():
    with pytest.raises(ConfigError, match="var_freeze_step is not a parameter of OneBitLamb"):
        load_runtime_config({"optimizer": {"type": "OneBitLamb", "params": {"var_freeze_step": 3}}}, 1)
    with pytest.raises(ConfigError, match="factor_max is not a parameter of ZeroOneAdam"):
        load_runtime_config({"optimizer": {"type": "ZeroOneAdam", "params": {"factor_max": 3.0}}}, 1)
