"""CPUAdam (the native CPU Adam/AdamW of megatron.runtime.optim) against torch's optimizers.

Where torch runs its AVX2 or AVX-512 kernels (this machine: AVX-512; ATEN_CPU_CAPABILITY=avx2
passes too) CPUAdam is bit-identical to torch.optim.AdamW(fused=True), and with adamw_mode=False
to torch.optim.Adam(fused=True). torch's foreach path, and its fused kernel in builds without
fused multiply-adds (ATEN_CPU_CAPABILITY=default), round in other places: there the comparison
allows rtol 1e-5, atol 1e-6 (measured: at most 1.6e-6 apart after 20 steps at lr 1e-2, where an
exp_avg near zero turns one rounding into a larger relative change of the update).
"""

import copy

import pytest
import torch

from megatron.runtime.optim import CPUAdam

BIT_EXACT = torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX2")
# a mix of sizes: scalar-loop tails of 1-7 elements, a tensor under one vector, and enough in all
# (above 2 x 65536 elements) that the extension splits the step over two threads
SHAPES = [(300, 500), (77,), (5, 3), (1,), (1024, 129)]
STEPS = 20


def make_params(seed: int = 0, shapes: list[tuple[int, ...]] = SHAPES) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]


def make_grads(params: list[torch.Tensor], steps: int, seed: int = 1) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [[0.1 * torch.randn(p.shape, generator=generator) for p in params] for _ in range(steps)]


def clone(params: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def train(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> None:
    for step_grads in grads:
        for param, grad in zip(params, step_grads):
            param.grad = None if grad is None else grad.clone()
        optimizer.step()


def assert_same(actual: torch.Tensor, expected: torch.Tensor, exact: bool = BIT_EXACT) -> None:
    if exact:
        assert torch.equal(actual, expected), f"{(actual != expected).sum().item()} of {actual.numel()} elements differ"
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def assert_same_training(
    ours: CPUAdam,
    our_params: list[torch.Tensor],
    torch_optimizer: torch.optim.Optimizer,
    torch_params: list[torch.Tensor],
    exact: bool = BIT_EXACT,
) -> None:
    for mine, theirs in zip(our_params, torch_params):
        assert_same(mine.detach(), theirs.detach(), exact)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert_same(ours.state[mine][key], torch_optimizer.state[theirs][key], exact)


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.9)], ids=["betas-default", "beta1-below-half"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam-l2"])
def test_matches_torch_fused(adamw_mode: bool, weight_decay: float, betas: tuple[float, float]) -> None:
    params = make_params()
    reference = clone(params)
    grads = make_grads(params, STEPS)
    ours = CPUAdam(params, lr=1e-2, betas=betas, eps=1e-8, weight_decay=weight_decay, adamw_mode=adamw_mode)
    torch_class = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    theirs = torch_class(reference, lr=1e-2, betas=betas, eps=1e-8, weight_decay=weight_decay, fused=True)
    train(ours, params, grads)
    train(theirs, reference, grads)
    assert_same_training(ours, params, theirs, reference)


def test_adam_without_weight_decay_keeps_an_infinite_parameter_infinite_like_torch() -> None:
    params = [torch.nn.Parameter(torch.tensor([float("inf"), 1.0, -2.0]))]
    reference = clone(params)
    grads = make_grads(params, 3)
    ours = CPUAdam(params, adamw_mode=False)
    theirs = torch.optim.Adam(reference, fused=True)
    train(ours, params, grads)
    train(theirs, reference, grads)
    assert params[0][0].item() == float("inf")
    assert_same_training(ours, params, theirs, reference)


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam-l2"])
def test_close_to_torch_foreach(adamw_mode: bool) -> None:
    params = make_params()
    reference = clone(params)
    grads = make_grads(params, STEPS)
    ours = CPUAdam(params, lr=1e-2, weight_decay=0.1, adamw_mode=adamw_mode)
    torch_class = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    theirs = torch_class(reference, lr=1e-2, weight_decay=0.1, foreach=True)
    train(ours, params, grads)
    train(theirs, reference, grads)
    assert_same_training(ours, params, theirs, reference, exact=False)


def test_thread_count_does_not_change_the_result() -> None:
    grads = make_grads(make_params(), STEPS)
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            params = make_params()
            train(CPUAdam(params, lr=1e-2, weight_decay=0.1), params, grads)
            results.append(params)
    finally:
        torch.set_num_threads(threads)
    for params in results[1:]:
        for mine, first in zip(params, results[0]):
            assert torch.equal(mine, first)


def reference_without_bias_correction(
    param: torch.Tensor,
    grads: list[torch.Tensor],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> torch.Tensor:
    """DeepSpeed's bias_correction=False AdamW in float64: step size lr, no second-moment correction."""
    param = param.detach().double().clone()
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    for grad in grads:
        grad = grad.double()
        param *= 1 - lr * weight_decay
        exp_avg.mul_(betas[0]).add_(grad, alpha=1 - betas[0])
        exp_avg_sq.mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
        param -= lr * exp_avg / (exp_avg_sq.sqrt() + eps)
    return param


def test_without_bias_correction() -> None:
    params = make_params(shapes=[(1000,), (13,)])
    initial = clone(params)
    grads = make_grads(params, STEPS)
    train(CPUAdam(params, lr=1e-2, bias_correction=False, weight_decay=0.1), params, grads)
    for param, start, index in zip(params, initial, range(len(params))):
        expected = reference_without_bias_correction(start, [g[index] for g in grads], 1e-2, (0.9, 0.999), 1e-8, 0.1)
        torch.testing.assert_close(param.detach().double(), expected, rtol=1e-5, atol=1e-6)


def test_param_groups_with_their_own_settings() -> None:
    params = make_params()
    reference = clone(params)
    grads = make_grads(params, STEPS)
    ours = CPUAdam(
        [
            {"params": params[:2], "lr": 1e-3, "weight_decay": 0.1, "adamw_mode": False},
            {"params": params[2:4], "betas": (0.8, 0.99)},
            {"params": params[4:], "eps": 1e-6, "weight_decay": 0.05},
        ],
        lr=1e-2,
    )
    adam = torch.optim.Adam(reference[:2], lr=1e-3, weight_decay=0.1, fused=True)
    adamw = torch.optim.AdamW(
        [
            {"params": reference[2:4], "betas": (0.8, 0.99), "weight_decay": 0.0},
            {"params": reference[4:], "eps": 1e-6, "weight_decay": 0.05},
        ],
        lr=1e-2,
        fused=True,
    )
    for step_grads in grads:
        for param, mirror, grad in zip(params, reference, step_grads):
            param.grad, mirror.grad = grad.clone(), grad.clone()
        ours.step()
        adam.step()
        adamw.step()
    assert_same_training(ours, params[:2], adam, reference[:2])
    assert_same_training(ours, params[2:], adamw, reference[2:])


def test_parameters_that_skip_steps_keep_their_own_step_count() -> None:
    params = make_params()
    reference = clone(params)
    grads = make_grads(params, STEPS)
    for step, step_grads in enumerate(grads):  # parameter 1 has no gradient in the first 5 steps
        if step < 5:
            step_grads[1] = None
    ours = CPUAdam(params, lr=1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1, fused=True)
    train(ours, params, grads)
    train(theirs, reference, grads)
    assert ours.state[params[1]]["step"].item() == STEPS - 5
    assert_same_training(ours, params, theirs, reference)


def trained(optimizer_class: type, grads: list[list[torch.Tensor]], **arguments) -> tuple:
    """(parameters, optimizer) after training fresh parameters on `grads`."""
    params = make_params()
    optimizer = optimizer_class(params, lr=1e-2, weight_decay=0.1, **arguments)
    train(optimizer, params, grads)
    return params, optimizer


def resumed(
    optimizer_class: type, params: list[torch.Tensor], state: dict, grads: list[list[torch.Tensor]], **arguments
) -> tuple:
    """(parameters, optimizer) of a fresh optimizer that loads `state` and trains on `grads`;
    lr 1.0 and no weight decay in its constructor, so the loaded groups must bring them back.
    The loaded groups replace the constructor's, so `arguments` (torch's fused=True, which our
    groups do not carry) are set on them again."""
    params = clone(params)
    optimizer = optimizer_class(params, lr=1.0, **arguments)
    optimizer.load_state_dict(copy.deepcopy(state))
    for group in optimizer.param_groups:
        group.update(arguments)
    train(optimizer, params, grads)
    return params, optimizer


@pytest.mark.parametrize("integer_steps", [False, True], ids=["torch-steps", "deepspeed-int-steps"])
def test_state_dict_resume_equals_uninterrupted(integer_steps: bool) -> None:
    grads = make_grads(make_params(), 10)
    straight, uninterrupted = trained(CPUAdam, grads)
    first, before = trained(CPUAdam, grads[:5])
    state = before.state_dict()
    assert set(state["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["state"][0]["step"].dtype == torch.float32
    if integer_steps:  # DeepSpeedCPUAdam keeps the step as an int
        for param_state in state["state"].values():
            param_state["step"] = int(param_state["step"].item())
    params, after = resumed(CPUAdam, first, state, grads[5:])
    assert_same_training(after, params, uninterrupted, straight, exact=True)


def test_state_dicts_interoperate_with_torch_adamw() -> None:
    grads = make_grads(make_params(), 10)
    straight, uninterrupted = trained(CPUAdam, grads)
    first, ours = trained(CPUAdam, grads[:5])
    params, in_torch = resumed(torch.optim.AdamW, first, ours.state_dict(), grads[5:], fused=True)
    assert_same_training(uninterrupted, straight, in_torch, params)
    first, theirs = trained(torch.optim.AdamW, grads[:5], fused=True)
    params, back = resumed(CPUAdam, first, theirs.state_dict(), grads[5:])
    assert_same_training(back, params, uninterrupted, straight)


def test_zero_size_and_gradless_parameters() -> None:
    params = make_params(shapes=[(0,), (4, 0), (33,)])
    frozen = torch.nn.Parameter(torch.ones(3))
    optimizer = CPUAdam(params + [frozen], lr=1e-2)
    train(optimizer, params + [frozen], [[*step_grads, None] for step_grads in make_grads(params, 3)])
    assert optimizer.state[params[0]]["exp_avg"].shape == (0,)
    assert optimizer.state[params[1]]["exp_avg_sq"].shape == (4, 0)
    assert optimizer.state[params[2]]["step"].item() == 3
    assert frozen not in optimizer.state and torch.equal(frozen, torch.ones(3))


def test_closure_loss_is_returned() -> None:
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = CPUAdam([param])

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = (param * param).sum()
        loss.backward()
        return loss

    assert optimizer.step(closure).item() == 4.0
    assert (param < 1).all()


def step_once(param: torch.Tensor, grad: torch.Tensor | None = None) -> CPUAdam:
    optimizer = CPUAdam([param])
    param.grad = torch.ones_like(param) if grad is None else grad
    optimizer.step()
    return optimizer


def test_non_contiguous_parameter_is_refused() -> None:
    param = torch.nn.Parameter(torch.randn(4, 6).t())
    with pytest.raises(ValueError, match="contiguous tensors, but the parameter of shape \\(6, 4\\) is not"):
        step_once(param)


def test_non_contiguous_gradient_is_refused() -> None:
    param = torch.nn.Parameter(torch.randn(6, 4))
    with pytest.raises(ValueError, match="contiguous tensors, but the gradient"):
        step_once(param, torch.ones(4, 6).t())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_dtypes_are_refused(dtype: torch.dtype) -> None:
    param = torch.nn.Parameter(torch.randn(8, dtype=dtype))
    with pytest.raises(TypeError, match=f"float32 tensors, but the parameter of shape \\(8,\\) is {dtype}"):
        step_once(param)


def test_sparse_gradient_is_refused() -> None:
    param = torch.nn.Parameter(torch.randn(5, 3))
    with pytest.raises(TypeError, match="dense tensors, but the gradient"):
        step_once(param, torch.ones(5, 3).to_sparse())


def test_state_of_another_shape_is_refused_at_load() -> None:
    optimizer = step_once(torch.nn.Parameter(torch.randn(8)))
    loading = CPUAdam([torch.nn.Parameter(torch.randn(9))])
    with pytest.raises(ValueError, match="exp_avg of shape \\(8,\\) for the parameter of shape \\(9,\\)"):
        loading.load_state_dict(optimizer.state_dict())


def test_amsgrad_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="does not implement amsgrad"):
        CPUAdam([torch.nn.Parameter(torch.ones(2))], amsgrad=True)


@pytest.mark.parametrize("arguments", [{"lr": -1.0}, {"eps": -1e-8}, {"betas": (1.0, 0.999)}, {"weight_decay": -0.1}])
def test_bad_hyperparameters_are_refused(arguments: dict) -> None:
    with pytest.raises(ValueError, match="CPUAdam needs"):
        CPUAdam([torch.nn.Parameter(torch.ones(2))], **arguments)
