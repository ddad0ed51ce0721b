import math

import pytest
import torch

from megatron.errors import ConfigError
from megatron.parallel import single_process_grid
from megatron.runtime import initialize, load_runtime_config
from megatron.runtime.loss_scaler import DynamicLossScaler, LossScaleError
from megatron.runtime.lr_schedules import AnnealingLR

SINGLE = single_process_grid(torch.device("cpu"))


def small_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def run_steps(micro_batch: int, accumulation: int, clip: float = 0.0, steps: int = 3) -> list[torch.Tensor]:
    model = small_model()
    engine = initialize(
        model,
        {
            "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": accumulation,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "gradient_clipping": clip,
        },
        SINGLE,
    )
    data = torch.randn(steps * 4, 8, generator=torch.Generator().manual_seed(1))
    target = data.sum(dim=1, keepdim=True)
    for step in range(steps):
        for micro in range(accumulation):
            start = step * 4 + micro * micro_batch
            x, y = data[start : start + micro_batch], target[start : start + micro_batch]
            loss = ((engine(x) - y) ** 2).mean()
            engine.backward(loss)
            engine.step()
    assert engine.global_steps == steps
    return [p.detach().clone() for p in model.parameters()]


def test_gradient_accumulation_4x1_equals_1x4():
    for a, b in zip(run_steps(4, 1), run_steps(1, 4)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_clipping_matches_torch_clip_grad_norm():
    model = small_model()
    reference = small_model()
    engine = initialize(
        model, {"train_batch_size": 4, "gradient_clipping": 0.1, "optimizer": {"params": {"lr": 0.1}}}, SINGLE
    )
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.0)
    x, y = torch.randn(4, 8), torch.randn(4, 1) * 100
    engine.backward(((engine(x) - y) ** 2).mean())
    engine.step()
    ((reference(x) - y) ** 2).mean().backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    optimizer.step()
    assert engine.last_grad_norm == pytest.approx(float(norm), rel=1e-5)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b)


def test_fp16_overflow_skips_the_step_and_lowers_the_scale(capsys):
    model = small_model()
    before = [p.detach().clone() for p in model.parameters()]
    engine = initialize(
        model,
        {
            "train_batch_size": 2,
            "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
            "optimizer": {"params": {"lr": 0.1}},
        },
        SINGLE,
    )
    engine.backward(engine(torch.full((2, 8), float("inf"))).sum())
    engine.step()
    assert engine.last_step_skipped and engine.skipped_steps == 1
    assert engine.loss_scaler.scale == 2.0**7
    assert "step 1: gradient overflow at loss scale 256; skipping" in capsys.readouterr().out
    for a, b in zip(before, model.parameters()):
        torch.testing.assert_close(a, b)


def test_bf16_skips_a_step_with_non_finite_gradients_and_says_so(capsys):
    engine = initialize(small_model(), {"train_batch_size": 2, "bf16": {"enabled": True}}, SINGLE)
    engine.backward(engine(torch.full((2, 8), float("nan"))).sum())
    engine.step()
    assert engine.last_step_skipped and engine.consecutive_skipped_steps == 1
    assert engine.last_nonfinite.loss_ranks == [0] and engine.last_nonfinite.grad_ranks == [0]
    assert (
        "step 1: the loss is not finite on rank 0 and the gradient norm is not finite on rank 0; skipping"
        in capsys.readouterr().out
    )


def lamb_reference(
    param: torch.Tensor,
    grads: list[torch.Tensor],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    max_coeff: float,
    min_coeff: float,
) -> torch.Tensor:
    """LAMB written out step by step, as DeepSpeed's FusedLamb computes it."""
    w, m, v = param.clone().double(), torch.zeros_like(param).double(), torch.zeros_like(param).double()
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        update = (m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps) + weight_decay * w
        ratio = min(max(float(w.norm() / update.norm()), min_coeff), max_coeff)
        w = w - lr * ratio * update
    return w.float()


def test_lamb_follows_its_formula_and_is_built_from_the_config():
    torch.manual_seed(0)
    settings = dict(lr=0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, max_coeff=2.0, min_coeff=0.5)
    for scale in (1e-3, 1.0, 1e3):  # trust ratios below, inside and above the clamp
        param = torch.nn.Parameter(torch.randn(5, 4) * scale)
        start = param.detach().clone()
        grads = [torch.randn(5, 4) for _ in range(4)]
        optimizer = initialize(
            torch.nn.Linear(1, 1),
            {
                "train_batch_size": 1,
                "optimizer": {"type": "Lamb", "params": {**settings, "betas": list(settings["betas"])}},
            },
            SINGLE,
            model_parameters=[{"params": [param]}],
        ).optimizer
        for grad in grads:
            param.grad = grad
            optimizer.step()
        torch.testing.assert_close(param.detach(), lamb_reference(start, grads, **settings), rtol=1e-5, atol=1e-7)
    with pytest.raises(ConfigError, match="Lamb needs whole tensors .* zero_optimization.stage 0"):
        initialize(
            small_model(),
            {"train_batch_size": 1, "optimizer": {"type": "Lamb"}, "zero_optimization": {"stage": 1}},
            SINGLE,
        )
    with pytest.raises(ConfigError, match="unknown key 'optimizer.params.max_grad_nrm'"):
        initialize(
            small_model(), {"train_batch_size": 1, "optimizer": {"type": "Lamb", "params": {"max_grad_nrm": 1}}}, SINGLE
        )


def test_model_parameters_choose_what_the_built_optimizer_updates():
    model = small_model()
    engine = initialize(
        model,
        {"train_batch_size": 1, "optimizer": {"params": {"weight_decay": 0.1}}},
        SINGLE,
        model_parameters=model[2].parameters(),
    )
    # as DeepSpeed builds it: the parameters given are one group, all decayed (bias too)
    assert [(len(g["params"]), g["weight_decay"]) for g in engine.optimizer.param_groups] == [(2, 0.1)]
    engine.backward(engine(torch.randn(1, 8)).sum())
    first_layer = model[0].weight.detach().clone()
    engine.step()
    torch.testing.assert_close(model[0].weight.detach(), first_layer)


def test_an_optimizer_comes_as_deepspeed_takes_it_and_a_missing_model_is_one_sentence():
    model = small_model()
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    # an optimizer given with model_parameters: the optimizer is used as it is, as in DeepSpeed
    engine = initialize(model, {"train_batch_size": 1}, SINGLE, optimizer=sgd, model_parameters=model.parameters())
    assert engine.optimizer is sgd
    # a callable builds it from model_parameters
    built = initialize(
        model,
        {"train_batch_size": 1},
        SINGLE,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
        model_parameters=model[2].parameters(),
    ).optimizer
    assert isinstance(built, torch.optim.SGD) and [len(g["params"]) for g in built.param_groups] == [2]
    with pytest.raises(ConfigError, match=r"^initialize\(\) needs the model as a torch.nn.Module, not NoneType$"):
        initialize(None, {"train_batch_size": 1}, SINGLE)


def test_parameter_groups_given_are_kept_as_given():
    """DeepSpeed hands the caller's groups to the optimizer unchanged: their own learning rates and
    weight decay, in their order; the config's values fill only what a group leaves out."""
    model = small_model()
    groups = [
        {"params": [model[0].bias, model[2].weight], "weight_decay": 0.0, "lr": 0.5},
        {"params": [model[0].weight]},
        {"params": [model[2].bias], "lr": 0.25},
    ]
    engine = initialize(
        model,
        {"train_batch_size": 1, "optimizer": {"params": {"lr": 0.1, "weight_decay": 0.01}}},
        SINGLE,
        model_parameters=groups,
    )
    kept = engine.optimizer.param_groups
    assert [[id(p) for p in g["params"]] for g in kept] == [[id(p) for p in g["params"]] for g in groups]
    assert [g["weight_decay"] for g in kept] == [0.0, 0.01, 0.01]
    assert engine.get_lr() == [0.5, 0.1, 0.25]
    default = initialize(
        small_model(), {"train_batch_size": 1, "optimizer": {"params": {"weight_decay": 0.01}}}, SINGLE
    )
    # without model_parameters the toolkit's own grouping: matrices decayed, biases not
    assert [(len(g["params"]), g["weight_decay"]) for g in default.optimizer.param_groups] == [(2, 0.01), (2, 0.0)]


def test_engine_prints_progress_with_timings_and_writes_tensorboard(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = {
        "train_batch_size": 2,
        "steps_per_print": 2,
        "wall_clock_breakdown": True,
        "tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "job"},
    }
    engine = initialize(small_model(), config, SINGLE)
    losses = []
    for _ in range(4):
        loss = engine(torch.randn(2, 8)).square().mean()
        losses.append(float(loss.detach()))
        engine.backward(loss)
        engine.step()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[engine]")]
    assert len(lines) == 2 and lines[1].startswith("[engine] step=4, skipped=0, lr=")
    assert "ms per step: forward" in lines[0] and "backward" in lines[0] and "step" in lines[0]
    events = EventAccumulator(str(tmp_path / "job"))
    events.Reload()
    train_loss = events.Scalars("Train/Samples/train_loss")
    assert [e.step for e in train_loss] == [2, 4, 6, 8]  # samples seen
    assert [e.value for e in train_loss] == pytest.approx(losses)
    assert {"Train/Samples/lr", "Train/Samples/loss_scale"} <= set(events.Tags()["scalars"])


def test_dynamic_loss_scaler_follows_deepspeed_rules():
    scaler = DynamicLossScaler(init_scale=2.0**4, scale_window=3, hysteresis=2, min_scale=2.0)
    scaler.update(True)  # hysteresis absorbs the first overflow
    assert scaler.scale == 16
    scaler.update(True)
    assert scaler.scale == 8
    for _ in range(2):
        scaler.update(False)
    assert scaler.scale == 8
    scaler.update(False)  # third clean step since the overflow doubles the scale
    assert scaler.scale == 16
    scaler = DynamicLossScaler(init_scale=2.0, hysteresis=1, min_scale=2.0)
    with pytest.raises(LossScaleError, match="minimum loss scale"):
        scaler.update(True)


def lrs(style: str, warmup: int, decay: int, steps: int, increment: int = 1) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = AnnealingLR(
        optimizer,
        max_lr=1.0,
        min_lr=0.1,
        warmup_steps=warmup,
        decay_steps=decay,
        decay_style=style,
        increment=increment,
    )
    values = [optimizer.param_groups[0]["lr"]]
    for _ in range(steps):
        schedule.step()
        values.append(optimizer.param_groups[0]["lr"])
    return values


def test_megatron_annealing_warmup_then_decay():
    assert lrs("linear", 2, 6, 7) == pytest.approx([0.0, 0.5, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1])
    cosine = lrs("cosine", 0, 4, 4)
    assert cosine == pytest.approx([0.1 + 0.9 * 0.5 * (math.cos(math.pi * s / 4) + 1) for s in range(5)])
    assert lrs("constant", 1, 0, 3) == pytest.approx([0.0, 1.0, 1.0, 1.0])
    assert lrs("linear", 200, 600, 7, increment=100) == pytest.approx(lrs("linear", 2, 6, 7))


def test_runtime_config_resolves_batch_sizes_and_rejects_contradictions():
    config = load_runtime_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, dp_size=2)
    assert config.gradient_accumulation_steps == 4
    with pytest.raises(ConfigError, match="train_batch_size 30"):
        load_runtime_config({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, dp_size=2)


def test_unknown_runtime_key_suggests_the_nearest():
    with pytest.raises(ConfigError, match="did you mean 'gradient_clipping'"):
        load_runtime_config({"train_batch_size": 4, "gradient_cliping": 1.0}, dp_size=1)
    with pytest.raises(ConfigError, match="fp16.initial_scale_powr.*'initial_scale_power'"):
        load_runtime_config({"train_batch_size": 4, "fp16": {"initial_scale_powr": 8}}, dp_size=1)


def test_config_scheduler_drives_the_learning_rate():
    engine = initialize(
        small_model(),
        {
            "train_batch_size": 2,
            "optimizer": {"params": {"lr": 0.1}},
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 4, "warmup_type": "linear"},
            },
        },
        SINGLE,
    )
    seen = []
    for _ in range(6):
        seen.append(engine.get_lr()[0])
        engine.backward(engine(torch.randn(2, 8)).sum())
        engine.step()
    # optimizer step n runs at t = n - 1; linear warmup gives 0.1 * t / 4 until t = 4
    assert seen == pytest.approx([0.0, 0.0, 0.025, 0.05, 0.075, 0.1])


def test_unknown_scheduler_and_bad_zero_settings_are_clear_errors():
    with pytest.raises(ConfigError, match="WarmupCosineLR"):
        initialize(small_model(), {"train_batch_size": 2, "scheduler": {"type": "WarmupCosine"}}, SINGLE)
    with pytest.raises(ConfigError, match="zero_optimization.stage.*should be 0, 1, 2 or 3"):
        load_runtime_config({"train_batch_size": 2, "zero_optimization": {"stage": 4}}, dp_size=1)
    with pytest.raises(
        ConfigError,
        match="bad value 0 for 'zero_optimization.offload_param.buffer_count' .* greater than or equal to 1",
    ):
        load_runtime_config(
            {"train_batch_size": 2, "zero_optimization": {"stage": 3, "offload_param": {"buffer_count": 0}}}, 1
        )
    with pytest.raises(ConfigError, match="unknown key 'aio.queue_dept'.*'queue_depth'"):
        load_runtime_config({"train_batch_size": 2, "aio": {"queue_dept": 4}}, dp_size=1)
    with pytest.raises(
        ConfigError, match="bad value .* for 'zero_optimization.reduce_bucket_size' .* greater than or equal to 1"
    ):
        load_runtime_config({"train_batch_size": 2, "zero_optimization": {"reduce_bucket_size": 0}}, dp_size=1)


def test_resumed_optimizer_settings_that_the_checkpoint_replaces_are_named(tmp_path, capsys):
    """As in DeepSpeed and Megatron, the checkpoint's optimizer keeps its own settings; a changed
    weight decay or beta is then named in one line instead of vanishing silently."""

    def engine(weight_decay: float, beta2: float, schedule: dict | None = None):
        config = {"train_batch_size": 1, "optimizer": {"params": {"weight_decay": weight_decay, "betas": [0.9, beta2]}}}
        return initialize(small_model(), {**config, **(schedule or {})}, SINGLE)

    saved = engine(0.1, 0.95)
    saved.backward(saved(torch.randn(1, 8)).sum())
    saved.step()
    saved.save_checkpoint(tmp_path, "one")
    capsys.readouterr()
    same = engine(0.1, 0.95)
    same.load_checkpoint(tmp_path, "one")
    assert "is ignored" not in capsys.readouterr().out
    changed = engine(0.05, 0.99)
    changed.load_checkpoint(tmp_path, "one")
    line = [out for out in capsys.readouterr().out.splitlines() if "is ignored" in out]
    assert line == [
        " > resuming: this run's optimizer betas (0.9, 0.99) (checkpoint: (0.9, 0.95)), weight_decay 0.05 "
        "(checkpoint: 0.1) is ignored: the checkpoint's optimizer state keeps its own, as in DeepSpeed and "
        "Megatron; load with --no-load-optim (load_optimizer=False) to start the optimizer afresh with the "
        "new settings"
    ]
    assert changed.optimizer.param_groups[0]["weight_decay"] == 0.1
