import shutil

import pytest
import torch
import torch.nn.functional as F

from megatron.checkpoint.layout import LATEST_FILE
from megatron.config.flags import parse_args
from megatron.errors import CheckpointError, ConfigError
from megatron.parallel import build_parallel_grid, single_process_grid
from megatron.placement import tensor_parallel_split
from megatron.training.loop import Trainer
from megatron.training.losses import kd_divergence_BS, masked_mean
from tests.dist_utils import run_distributed
from tests.training_fixtures import MODERN_MOE, tiny_config, tiny_flags, write_corpus

SINGLE = single_process_grid(torch.device("cpu"))
NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def teacher(corpus, tmp_path_factory) -> str:
    """A 4-layer MoE teacher (4 experts on layers 2 and 4), trained a little and saved."""
    save = tmp_path_factory.mktemp("teacher") / "ckpt"
    Trainer(
        tiny_config(corpus, num_layers=4, num_experts=[4], train_iters=4, save=str(save), **NO_DROPOUT), SINGLE
    ).train()
    return str(save)


def kd_config(corpus: str, teacher: str, **overrides):
    flags = {
        "num_layers": 2,
        "kd": True,
        "load_teacher": teacher,
        "eval_interval": 100,
        "lr_warmup_iters": None,
        **NO_DROPOUT,
        **overrides,
    }
    return tiny_config(corpus, **flags)


def test_kd_divergence_is_temperature_scaled_kl_of_softened_distributions():
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    for temperature in (1.0, 2.5):
        p = F.softmax(teacher / temperature, -1)
        expected = (p * (p.log() - F.log_softmax(student / temperature, -1))).sum(-1) * temperature**2
        torch.testing.assert_close(kd_divergence_BS(student, teacher, temperature), expected)
    assert kd_divergence_BS(teacher, teacher, 2.0).abs().max() < 1e-6
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    values = torch.arange(6.0).view(2, 3)
    assert masked_mean(values, mask) == pytest.approx((0 + 2 + 5) / 3)


def test_kd_term_starts_near_zero_with_the_student_initialised_from_its_teacher(corpus, teacher, capsys):
    # the same shape as the teacher: every weight copied, so the student's logits are the teacher's
    trainer = Trainer(
        kd_config(
            corpus,
            teacher,
            num_layers=4,
            num_experts=[4],
            train_iters=1,
            mos_init_from_teacher=True,
            disable_moe_token_dropping=True,
        ),
        SINGLE,
    )
    result = trainer.train()
    assert result.kd_losses[0] < 1e-5
    out = capsys.readouterr().out
    assert "student initialised from the teacher" in out and "layers 1-4 whole" in out
    assert "kd loss:" in out


def test_init_from_teacher_keeps_the_layers_the_student_has(corpus, teacher, capsys):
    # student: 3 layers, 8 experts on layer 2 where the teacher has 4 -> layer 2's MoE stays fresh
    trainer = Trainer(
        kd_config(corpus, teacher, num_layers=3, num_experts=[8], train_iters=1, mos_init_from_teacher=True), SINGLE
    )
    out = capsys.readouterr().out
    assert "layers 1, 3 whole; layers 2 partly" in out and "teacher layers 4 unused" in out
    student, teacher_model = trainer.engine.module.state_dict(), trainer.teacher.state_dict()
    for name in ("word_embeddings.weight", "layers.2.mlp.dense_h_to_4h.weight", "layers.1.self_attention.dense.weight"):
        torch.testing.assert_close(student[name], teacher_model[name])
    assert student["layers.1.mlp.router.weight"].shape[0] == 8 != teacher_model["layers.1.mlp.router.weight"].shape[0]


def test_a_modern_moe_student_distils_from_a_modern_teacher(corpus, tmp_path):
    """MoS with today's architecture on both sides (SwiGLU bias-free fine-grained and shared experts,
    sigmoid routing with expert bias, GQA, rope, untied head): the student starts as the teacher."""
    save = tmp_path / "teacher"
    Trainer(
        tiny_config(corpus, num_layers=4, train_iters=3, save=str(save), **NO_DROPOUT, **MODERN_MOE), SINGLE
    ).train()
    trainer = Trainer(
        kd_config(
            corpus,
            str(save),
            num_layers=4,
            train_iters=1,
            mos_init_from_teacher=True,
            disable_moe_token_dropping=True,
            **MODERN_MOE,
        ),
        SINGLE,
    )
    assert trainer.train().kd_losses[0] < 1e-5


@pytest.mark.parametrize(
    "options, message",
    [
        ({"swiglu": True, "ffn_hidden_size": 64}, "swiglu False there, True here"),  # the same [128, 32] first weight
        ({"group_query_attention": True, "num_query_groups": 4}, "QKV layout on one side only"),  # G = N: same shape
    ],
)
def test_init_from_teacher_refuses_same_shaped_tensors_of_another_meaning(corpus, teacher, options, message):
    with pytest.raises(ConfigError, match=message):
        Trainer(kd_config(corpus, teacher, train_iters=1, mos_init_from_teacher=True, **options), SINGLE)


def test_alpha_weights_the_students_own_lm_loss(corpus, teacher):
    def first_step(alpha: float) -> torch.Tensor:
        trainer = Trainer(kd_config(corpus, teacher, train_iters=1, kd_alpha_ce=alpha), SINGLE)
        trainer.train()
        return torch.cat([p.detach().flatten() for p in trainer.engine.module.parameters()])

    assert not torch.allclose(first_step(1.0), first_step(0.0))


def test_staged_kd_stops_frees_the_teacher_and_a_later_resume_never_reads_it(corpus, teacher, tmp_path, capsys):
    teacher_copy = tmp_path / "teacher"
    shutil.copytree(teacher, teacher_copy)
    save = tmp_path / "student"
    full = Trainer(
        kd_config(corpus, str(teacher_copy), train_iters=6, kd_stop_iters=3, save=str(save), save_interval=4), SINGLE
    )
    result = full.train()
    assert all(kd > 0 for kd in result.kd_losses[:3]) and result.kd_losses[3:] == [0.0, 0.0, 0.0]
    assert full.teacher is None
    assert "knowledge distillation stopped at iteration 3: teacher freed" in capsys.readouterr().out
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(save / "iter_0000004", resumed_dir / "iter_0000004")
    (resumed_dir / LATEST_FILE).write_text("4\n")
    shutil.rmtree(teacher_copy)  # a resume after the stop must not need the teacher
    resumed = Trainer(
        kd_config(corpus, str(teacher_copy), train_iters=6, kd_stop_iters=3, load=str(resumed_dir)), SINGLE
    )
    assert resumed.teacher is None and "the teacher is not loaded" in capsys.readouterr().out
    assert resumed.train().losses == result.losses[4:]


def test_teacher_targets_do_not_depend_on_the_micro_batch_split(corpus, teacher):
    """The teacher runs dropless, so 4 micro-batches of 1 equal 1 micro-batch of 4 with KD on."""

    def kd_losses(micro_batch_size: int) -> list[float]:
        config = kd_config(corpus, teacher, train_iters=2, micro_batch_size=micro_batch_size, global_batch_size=4)
        return Trainer(config, SINGLE).train().kd_losses

    torch.testing.assert_close(kd_losses(1), kd_losses(4), rtol=1e-4, atol=1e-6)


def _kd_parameters(corpus: str, teacher: str, dp_size: int) -> dict[str, torch.Tensor]:
    grid = build_parallel_grid(torch.device("cpu"), ep_size=dp_size)
    config = kd_config(
        corpus,
        teacher,
        dp_size=dp_size,
        train_iters=3,
        micro_batch_size=1,
        global_batch_size=4,
        moe_expert_parallel_size=dp_size,
    )
    trainer = Trainer(config, grid)
    result = trainer.train()
    params = {name: p.detach().clone() for name, p in trainer.engine.module.named_parameters()}
    params["kd"] = torch.tensor(result.kd_losses, dtype=torch.float64)
    return params


def test_teacher_loads_with_another_expert_parallel_size_and_kd_equals_one_process(corpus, teacher):
    single = _kd_parameters(corpus, teacher, 1)
    ranks = run_distributed(_kd_parameters, 2, corpus, teacher, 2)  # the teacher's experts split over 2 ranks
    kd = single.pop("kd")  # each rank logs the KD loss of its own half of the batch
    torch.testing.assert_close((ranks[0].pop("kd") + ranks[1].pop("kd")) / 2, kd, rtol=1e-4, atol=1e-6)
    for name, value in single.items():
        torch.testing.assert_close(ranks[0][name], value, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def tp_teacher(corpus, tmp_path_factory) -> str:
    """The teacher again, its vocabulary padded to 64 rows: what a student pads to at TP=2 with
    --make-vocab-size-divisible-by 32."""
    save = tmp_path_factory.mktemp("tp_teacher") / "ckpt"
    Trainer(
        tiny_config(
            corpus,
            num_layers=4,
            num_experts=[4],
            train_iters=4,
            save=str(save),
            make_vocab_size_divisible_by=64,
            **NO_DROPOUT,
        ),
        SINGLE,
    ).train()
    return str(save)


def _kd_model_parallel(
    corpus: str, teacher: str, tp_size: int, expert_tp_size: int, pp_size: int = 1
) -> dict[str, torch.Tensor]:
    """An MoE student initialised from the teacher and distilled from it for 3 iterations, with the
    student and the teacher split over tp_size (and their experts over expert_tp_size), the student
    over pp_size pipeline stages; this rank's student parameters (whole), the KD losses and the
    teacher's parameter count on the rank (0 on a pipeline stage without it)."""
    grid = build_parallel_grid(torch.device("cpu"), tp_size=tp_size, expert_tp_size=expert_tp_size, pp_size=pp_size)
    config = kd_config(
        corpus,
        teacher,
        train_iters=3,
        num_experts=[4],
        disable_moe_token_dropping=True,
        mos_init_from_teacher=True,
        make_vocab_size_divisible_by=32,
        tensor_model_parallel_size=tp_size,
        sequence_parallel=tp_size > 1,
        expert_tensor_parallel_size=expert_tp_size,
        pipeline_model_parallel_size=pp_size,
    )
    trainer = Trainer(config, grid)
    teacher_numel = sum(p.numel() for p in trainer.teacher.parameters()) if trainer.teacher is not None else 0
    result = trainer.train()
    params = {
        name: (
            p.detach() if tensor_parallel_split(p) is None else tensor_parallel_split(p).whole_of(p.detach())
        ).clone()
        for name, p in trainer.engine.module.named_parameters()
    }
    return {
        **params,
        "kd": torch.tensor(result.kd_losses, dtype=torch.float64),
        "teacher_numel": torch.tensor(teacher_numel),
    }


def test_kd_under_tensor_and_expert_tensor_parallelism_equals_one_process(corpus, tp_teacher):
    single = _kd_model_parallel(corpus, tp_teacher, 1, 1)
    assert len(single["kd"]) == 3 and single["kd"].min() > 0
    whole_teacher = single.pop("teacher_numel")
    for expert_tp_size in (1, 2):  # the teacher split as the student is; both ranks see the whole batch
        for rank, result in enumerate(run_distributed(_kd_model_parallel, 2, corpus, tp_teacher, 2, expert_tp_size)):
            assert result.pop("teacher_numel") < (0.7 if expert_tp_size == 2 else 0.9) * whole_teacher
            for name, value in single.items():
                torch.testing.assert_close(
                    result[name],
                    value,
                    rtol=1e-4,
                    atol=1e-5,
                    msg=f"TP=2 expert-TP={expert_tp_size} rank {rank}: {name}",
                )


def test_kd_under_pipeline_parallelism_equals_one_process(corpus, tp_teacher):
    """PP=2 (a layer per stage): the last stage runs the whole teacher; every stage's parameters and
    the KD losses equal one process's, the student initialised from the teacher stage by stage."""
    single = _kd_model_parallel(corpus, tp_teacher, 1, 1)
    whole_teacher = single.pop("teacher_numel")
    first, last = run_distributed(_kd_model_parallel, 2, corpus, tp_teacher, 1, 1, 2)
    assert (first.pop("teacher_numel"), last.pop("teacher_numel")) == (0, whole_teacher)
    assert "layers.0.self_attention.query_key_value.weight" in first and "layers.1.mlp.router.weight" in last
    for stage, result in enumerate((first, last)):
        for name, value in result.items():
            torch.testing.assert_close(value, single[name], rtol=1e-4, atol=1e-5, msg=f"stage {stage}: {name}")


def test_teacher_errors_name_the_problem_before_training(corpus, teacher, tmp_path):
    with pytest.raises(CheckpointError, match=r"--load-teacher .* holds no checkpoint"):
        Trainer(kd_config(corpus, str(tmp_path / "nothing")), SINGLE)
    with pytest.raises(
        ConfigError,
        match=r"--num-layers-teacher 6 but the checkpoint has 4; "
        r"--num-experts-teacher 8 but the checkpoint has \[1, 4, 1, 4\]",
    ):
        Trainer(kd_config(corpus, teacher, num_layers_teacher=6, num_experts_teacher=[8]), SINGLE)
    with pytest.raises(ConfigError, match="the teacher's vocabulary has 128 .* student's has 256"):
        Trainer(kd_config(corpus, teacher, vocab_size=200), SINGLE)
    Trainer(
        kd_config(corpus, teacher, num_layers_teacher=4, num_experts_teacher=[4, 4], mlp_type_teacher="standard"),
        SINGLE,
    )  # flags that state the teacher correctly are fine


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"kd": True}, "add --load-teacher DIR"),
        ({"num_layers_teacher": 4}, "--num-layers-teacher was given without --kd"),
        ({"kd": True, "load_teacher": "t", "kd_stop_iters": 2, "kd_stop_tokens": 64}, "use only one of them"),
        ({"load_teacher": "t", "mos_init_from_teacher": True, "kd_stop_iters": 2}, "stop a KD term that is off"),
        ({"kd": True, "load_teacher": "t", "kd_temp": 0}, "--kd-temp: .0. is not a positive number"),
    ],
)
def test_distillation_flag_errors(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(tiny_flags("corpus", **extra))


def test_kd_stop_tokens_become_iterations_and_mos_means_kd():
    config = parse_args(tiny_flags("corpus", mos=True, load_teacher="t", kd_stop_tokens=100))
    assert config.distill.kd and config.distill.stop_iteration == 2  # 4 x 16 tokens per iteration
    assert config.distill.kd_active(1) and not config.distill.kd_active(2)
