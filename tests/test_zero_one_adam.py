"""0/1 Adam (`"type": "ZeroOneAdam"`): on 2 gloo ranks equal to the algorithm written out for
simulated replicas in one process (variance steps on all-reduced gradients at doubling intervals,
compressed gradients between them, then local steps with compressed synchronisations at doubling
intervals); a resume between two synchronisations is bit-exact, and at another data-parallel size
each rank takes the saved replicas' mean parameters and momenta; an older checkpoint that kept
summed updates instead of the shared point resumes where they were zero and is refused elsewhere."""

import copy

import pytest
import torch

from megatron.errors import CheckpointError
from megatron.parallel import build_parallel_grid
from megatron.runtime import initialize
from megatron.runtime.optim.zero_one_adam import ZeroOneAdam
from tests.dist_utils import run_distributed
from tests.onebit_reference import ReferenceAveraging
from tests.test_onebit_adam import BETAS, EPS, LR, WD, model, parameters, replica_gradients, steps

RANKS, STEPS, VAR_FREEZE = 2, 11, 4
# short intervals so that a few steps cross every branch: the variance interval doubles after 2
# updates (steps 1, 2, then 4), local steps from step 6, synchronised every 1 then 2 steps
SETTINGS = {"var_freeze_step": VAR_FREEZE, "var_update_scaler": 2, "local_step_scaler": 2, "local_step_clipper": 2}


def config(ranks: int) -> dict:
    params = {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD, **SETTINGS}
    return {"train_batch_size": 4 * ranks, "optimizer": {"type": "ZeroOneAdam", "params": params}}


def _trained() -> dict[str, torch.Tensor]:
    engine = initialize(model(), config(RANKS), build_parallel_grid(torch.device("cpu")))
    assert isinstance(engine.optimizer, ZeroOneAdam)
    steps(engine, 0, STEPS)
    return parameters(engine, "p")


def simulated() -> list[dict[str, torch.Tensor]]:
    """Every replica's parameters after STEPS steps of 0/1 Adam written out."""
    replicas = [model() for _ in range(RANKS)]
    params = [dict(r.named_parameters()) for r in replicas]
    names = list(params[0])
    padded = {n: -(-params[0][n].numel() // (8 * RANKS)) * 8 * RANKS for n in names}
    averaging = {n: ReferenceAveraging(padded[n], RANKS) for n in names}
    m = [{n: torch.zeros_like(params[0][n]) for n in names} for _ in range(RANKS)]
    v = {n: torch.zeros_like(params[0][n]) for n in names}
    summed = [{n: torch.zeros_like(params[0][n]) for n in names} for _ in range(RANKS)]
    var_interval, var_counter, local_interval, local_counter, lrs = 1, 0, 1, 0, 0.0

    def mean_of(n: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        numel = tensors[0].numel()
        padded_tensors = [torch.cat([t.reshape(-1), torch.zeros(padded[n] - numel)]) for t in tensors]
        return averaging[n](padded_tensors)[:numel].view_as(tensors[0])

    for step in range(1, STEPS + 1):
        grads = replica_gradients(replicas, step - 1)
        frozen = step - 1 > VAR_FREEZE
        if step - 1 == VAR_FREEZE + 1:  # the error buffers restart for the updates
            averaging = {n: ReferenceAveraging(padded[n], RANKS) for n in names}
        if frozen:
            lrs += LR
        synchronise = frozen and step % local_interval == 0
        with torch.no_grad():
            for n in names:
                decay = WD if params[0][n].dim() >= 2 else 0.0
                if not frozen:
                    if step % var_interval == 0:
                        g = sum(gr[n] for gr in grads) / RANKS
                        v[n] = BETAS[1] * v[n] + (1 - BETAS[1]) * g * g
                    else:
                        g = mean_of(n, [gr[n] for gr in grads])
                    for rank in range(RANKS):
                        m[rank][n] = BETAS[0] * m[rank][n] + (1 - BETAS[0]) * g
                        params[rank][n] -= LR * (m[rank][n] / (v[n].sqrt() + EPS) + decay * params[rank][n])
                    continue
                denominator = v[n].sqrt() + EPS
                for rank in range(RANKS):
                    m[rank][n] = BETAS[0] * m[rank][n] + (1 - BETAS[0]) * grads[rank][n]
                    update = m[rank][n] / denominator + decay * params[rank][n]
                    params[rank][n] -= LR * update
                    summed[rank][n] -= LR * update
                if synchronise:
                    averaged = mean_of(n, [summed[rank][n] * denominator for rank in range(RANKS)])
                    for rank in range(RANKS):
                        params[rank][n] += averaged / denominator - summed[rank][n]
                        m[rank][n] = -averaged / lrs
                        summed[rank][n] = torch.zeros_like(summed[rank][n])
        if not frozen and step % var_interval == 0:
            var_counter += 1
            if var_counter == SETTINGS["var_update_scaler"]:
                var_counter, var_interval = 0, var_interval * 2
        if frozen:
            lrs = 0.0 if synchronise else lrs
            local_counter += 1
            if local_counter == SETTINGS["local_step_scaler"]:
                local_counter, local_interval = 0, min(SETTINGS["local_step_clipper"], local_interval * 2)
    return [{f"p/{n}": p[n].detach() for n in names} for p in params]


def test_two_ranks_equal_the_algorithm_simulated_in_one_process():
    expected = simulated()
    assert not torch.equal(expected[0]["p/0.weight"], expected[1]["p/0.weight"])  # ends between synchronisations
    for rank, want in zip(run_distributed(_trained, RANKS), expected):
        for name, value in want.items():
            torch.testing.assert_close(rank[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _straight_and_resumed(folder: str) -> dict[str, torch.Tensor]:
    grid = build_parallel_grid(torch.device("cpu"))
    straight = initialize(model(), config(RANKS), grid)
    steps(straight, 0, STEPS)
    first = initialize(model(), config(RANKS), grid)
    steps(first, 0, STEPS - 2)  # ends between two synchronisations: the replicas differ
    first.save_checkpoint(folder, "local")
    saved = parameters(first, "saved")
    again = initialize(model(), config(RANKS), grid)
    again.load_checkpoint(folder, "local")
    loaded = parameters(again, "loaded")
    steps(again, STEPS - 2, STEPS)
    return {**parameters(straight, "straight"), **parameters(again, "resumed"), **saved, **loaded}


def test_a_resume_between_synchronisations_is_bit_exact(tmp_path):
    ranks = run_distributed(_straight_and_resumed, RANKS, str(tmp_path))
    assert not torch.equal(ranks[0]["saved/0.weight"], ranks[1]["saved/0.weight"])
    for rank in ranks:
        for name in (n for n in rank if n.startswith("saved/")):  # each rank got its own parameters back
            assert torch.equal(rank[name], rank[name.replace("saved/", "loaded/")]), name
        for name in (n for n in rank if n.startswith("straight/")):
            assert torch.equal(rank[name], rank[name.replace("straight/", "resumed/")]), name


def _saved_at_four(folder: str) -> dict[str, torch.Tensor]:
    engine = initialize(model(), config(4), build_parallel_grid(torch.device("cpu")))
    steps(engine, 0, STEPS - 2)
    engine.save_checkpoint(folder, "dp4")
    return parameters(engine, "p")


def _loaded_at_two(folder: str) -> dict[str, torch.Tensor]:
    engine = initialize(model(), config(2), build_parallel_grid(torch.device("cpu")))
    engine.load_checkpoint(folder, "dp4")
    return parameters(engine, "p")


def test_at_another_data_parallel_size_each_rank_takes_the_replicas_mean(tmp_path):
    four = run_distributed(_saved_at_four, 4, str(tmp_path))
    two = run_distributed(_loaded_at_two, 2, str(tmp_path))
    for name in four[0]:
        mean = torch.stack([rank[name] for rank in four]).mean(0)
        for rank in two:
            torch.testing.assert_close(rank[name], mean, rtol=0, atol=0)


def _renamed_to_the_old_accumulator(optimizer: ZeroOneAdam) -> dict:
    """`optimizer`'s state dict as 54b3a75 wrote it: a summed-update buffer where the anchor is now."""
    saved = copy.deepcopy(optimizer.state_dict())
    for state in saved["state"].values():
        state["momentum_accumulator"] = torch.zeros_like(state.pop("anchor"))
    return saved


def test_an_older_checkpoint_resumes_at_a_synchronisation_and_is_refused_between_two():
    torch.manual_seed(0)
    param, grads = torch.nn.Parameter(torch.randn(8)), torch.randn(6, 8)
    optimizer = ZeroOneAdam([param], var_freeze_step=1, local_step_scaler=1, local_step_clipper=2, lr=0.1)

    def step(number: int) -> None:
        param.grad = grads[number - 1].clone()
        optimizer.step()

    # step 3 is the first local step, synchronised; from then on every even step synchronises
    for number in (1, 2, 3, 4):
        step(number)
    at_synchronisation, weights = _renamed_to_the_old_accumulator(optimizer), param.detach().clone()
    step(5)
    between = _renamed_to_the_old_accumulator(optimizer)
    step(6)
    expected = param.detach().clone()

    param.data.copy_(weights)
    optimizer.load_state_dict(at_synchronisation)
    step(5)
    step(6)
    assert torch.equal(param.detach(), expected)

    optimizer.load_state_dict(between)
    with pytest.raises(CheckpointError, match="saved between two synchronisations by an older version"):
        step(6)


def test_a_loaded_state_keeps_its_counters_on_the_host_as_float32():
    """torch's load_state_dict casts state to the parameter's dtype and device (a GPU there, where
    each read of a counter would wait for it); the counters come back as host float32 and the run
    goes on as the uninterrupted one."""
    torch.manual_seed(0)
    param, grads = torch.nn.Parameter(torch.randn(8, dtype=torch.float64)), torch.randn(6, 8, dtype=torch.float64)
    optimizer = ZeroOneAdam([param], var_freeze_step=1, local_step_scaler=1, local_step_clipper=2, lr=0.1)
    for number in range(4):
        param.grad = grads[number].clone()
        optimizer.step()
    saved, weights = copy.deepcopy(optimizer.state_dict()), param.detach().clone()
    for number in (4, 5):
        param.grad = grads[number].clone()
        optimizer.step()
    expected = param.detach().clone()
    param.data.copy_(weights)
    optimizer.load_state_dict(saved)
    state = optimizer.state[param]
    counters = ("var_interval", "var_counter", "local_step_interval", "local_step_counter", "lrs")
    assert all(state[key].dtype == torch.float32 and state[key].device.type == "cpu" for key in counters)
    for number in (4, 5):
        param.grad = grads[number].clone()
        optimizer.step()
    assert torch.equal(param.detach(), expected)
