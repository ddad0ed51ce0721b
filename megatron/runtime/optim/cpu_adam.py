"""Adam/AdamW on the CPU for optimizer state in host memory (ZeRO-Offload), stepped by the native
extension csrc/adam on torch's intra-op thread count.

The constructor takes DeepSpeedCPUAdam's arguments; the state holds torch's keys (`step` as a
float32 tensor, `exp_avg`, `exp_avg_sq`), so state dicts load into and from torch.optim.Adam(W).
The arithmetic is torch's: on CPUs where torch runs its AVX2 or AVX-512 kernels the results are
bit-identical to torch.optim.AdamW(fused=True) (Adam with adamw_mode=False); see
tests/test_cpu_adam.py. Parameters, gradients and state must be contiguous float32 CPU tensors.
"""

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

try:
    from megatron.ops import _cpu_adam

    _IMPORT_ERROR = None
except ImportError as error:  # the extension is built by `pip install -e .`
    _cpu_adam = None
    _IMPORT_ERROR = error

NOT_BUILT = (
    "The native CPU Adam extension megatron.ops._cpu_adam is not built; run `pip install -e .` "
    "in the repository root (needs gcc, Python headers and pybind11)."
)

# torch's AVX2 and AVX-512 fused kernels round the last (numel % 8) elements of a tensor in a
# scalar loop (AVX-512: after its 16-wide loop and gcc's 8-wide epilogue) whose fused multiply-add
# sits elsewhere; the extension copies that to stay bit-identical. Other builds: no tail (1).
_TORCH_SCALAR_TAIL = 8 if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX2") else 1

_GROUP_DEFAULT_KEYS = ("bias_correction", "adamw_mode", "amsgrad")


def _extension() -> Any:
    if _cpu_adam is None:
        raise ImportError(NOT_BUILT) from _IMPORT_ERROR
    return _cpu_adam


def _check_amsgrad(amsgrad: bool) -> None:
    if amsgrad:
        raise NotImplementedError(
            "CPUAdam does not implement amsgrad; pass amsgrad=False or use torch.optim.AdamW(amsgrad=True)"
        )


def _check_tensor(name: str, tensor: torch.Tensor, param: torch.Tensor) -> None:
    """One clear sentence for every tensor the extension could not read as a flat float32 run."""
    if (
        tensor.layout == torch.strided
        and tensor.is_cpu
        and tensor.dtype == torch.float32
        and tensor.shape == param.shape
        and tensor.is_contiguous()
    ):
        return  # the common case, kept cheap: this runs for four tensors per parameter per step
    shape = tuple(param.shape)
    subject = (
        f"the parameter of shape {shape}" if name == "parameter" else f"the {name} of the parameter of shape {shape}"
    )
    if tensor.layout != torch.strided:
        raise TypeError(f"CPUAdam needs dense tensors, but {subject} is {tensor.layout}")
    if not tensor.is_cpu:
        raise ValueError(f"CPUAdam steps CPU tensors, but {subject} is on {tensor.device}; use torch.optim.AdamW there")
    if tensor.dtype != torch.float32:
        raise TypeError(
            f"CPUAdam steps float32 tensors, but {subject} is {tensor.dtype}; keep fp32 master weights on the CPU"
        )
    if tensor.shape != param.shape:
        raise ValueError(
            f"CPUAdam found {name} of shape {tuple(tensor.shape)} for the parameter of shape {shape}; "
            "was the optimizer state loaded for another model?"
        )
    raise ValueError(
        f"CPUAdam needs contiguous tensors, but {subject} is not; "
        "make the parameter contiguous before building the optimizer"
    )


class CPUAdam(torch.optim.Optimizer):
    """DeepSpeedCPUAdam's interface: adamw_mode=True is AdamW (decoupled weight decay),
    False is Adam with L2 weight decay added to the gradient; bias_correction=False uses lr as
    the step size and no second-moment correction."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
    ) -> None:
        _check_amsgrad(amsgrad)
        if not lr >= 0.0:
            raise ValueError(f"CPUAdam needs lr >= 0, got {lr}")
        if not eps >= 0.0:
            raise ValueError(f"CPUAdam needs eps >= 0, got {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"CPUAdam needs both betas in [0, 1), got {tuple(betas)}")
        if not weight_decay >= 0.0:
            raise ValueError(f"CPUAdam needs weight_decay >= 0, got {weight_decay}")
        self._extension = _extension()
        self._one = torch.tensor(1.0)
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            adamw_mode=adamw_mode,
        )
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # groups of a torch.optim.AdamW state dict lack our keys, and DeepSpeed's steps are ints;
        # loaded state is checked here, once, so that step() checks only parameters and gradients
        super().__setstate__(state)
        for group in self.param_groups:
            for key in _GROUP_DEFAULT_KEYS:
                group.setdefault(key, self.defaults[key])
            for param in group["params"]:
                param_state = self.state.get(param, {})
                if "step" in param_state and not torch.is_tensor(param_state["step"]):
                    param_state["step"] = torch.tensor(float(param_state["step"]), dtype=torch.float32)
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in param_state:
                        _check_tensor(key, param_state[key], param)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        _check_amsgrad(group["amsgrad"])
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        states = [self._state_of(p) for p in params]
        steps = [s["step"] for s in states]
        # a tensor operand keeps foreach's per-tensor CPU loop from wrapping 1 into a new tensor each time
        torch._foreach_add_(steps, self._one, alpha=1.0)
        # one native call per distinct step count (a parameter without gradients skips steps)
        by_step: dict[float, list[int]] = defaultdict(list)
        for index, step in enumerate(torch.stack(steps).tolist()):
            by_step[step].append(index)
        beta1, beta2 = group["betas"]
        for step, indices in by_step.items():
            self._extension.adam_step(
                [params[i].data_ptr() for i in indices],
                [params[i].grad.data_ptr() for i in indices],
                [states[i]["exp_avg"].data_ptr() for i in indices],
                [states[i]["exp_avg_sq"].data_ptr() for i in indices],
                [params[i].numel() for i in indices],
                lr=float(group["lr"]),
                beta1=float(beta1),
                beta2=float(beta2),
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                step=step,
                bias_correction=bool(group["bias_correction"]),
                adamw_mode=bool(group["adamw_mode"]),
                num_threads=torch.get_num_threads(),
                tail_width=_TORCH_SCALAR_TAIL,
            )

    def _state_of(self, param: torch.Tensor) -> dict[str, Any]:
        """The parameter's state, created on its first step, after checking the parameter and gradient."""
        _check_tensor("parameter", param, param)
        _check_tensor("gradient", param.grad, param)
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
        return state
