"""ds_config files as DeepSpeed and Megatron-DeepSpeed users write them load as written: every
key DeepSpeed 0.19 reads is implemented, accepted with a log line saying it changes nothing here,
or refused with one sentence once the feature it turns on is not built here."""

import json
from pathlib import Path
from typing import get_args

import pytest
import torch
from pydantic import BaseModel
from safetensors.torch import load_file

from megatron.checkpoint.tensors import model_entries
from megatron.config.flags import parse_args, with_data_parallel_size
from megatron.errors import ConfigError
from megatron.parallel import build_parallel_grid, single_process_grid
from megatron.runtime import initialize
from megatron.runtime.config.deepspeed_keys import HINTS, UNBUILT, no_effect_notes
from megatron.runtime.config.hjson_text import HjsonError, parse_hjson
from megatron.runtime.config.schema import RuntimeConfig, load_runtime_config
from megatron.runtime.optim.cpu_adam import CPUAdam
from tests.dist_utils import run_distributed
from tests.test_zero import Net

SINGLE = single_process_grid(torch.device("cpu"))

MOE_TEMPLATE = """{
  "train_batch_size" : 16,
  "train_micro_batch_size_per_gpu": 2,
  "steps_per_print": 10,
  "zero_optimization": { "stage": 2 },
  "gradient_clipping": 1.0,
  "prescale_gradients": false,
  "fp16": { "enabled": false, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
            "min_loss_scale": 1, "initial_scale_power": 11 },
  "bf16": { "enabled": true },
  "curriculum_learning": { "enabled": CL, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 64,
                           "schedule_type": "fixed_linear",
                           "schedule_config": { "total_curriculum_step": 100, "difficulty_step": 8 } },
  "wall_clock_breakdown" : true
}"""

BERT_FP16 = """{
  // a BERT-style run: gradients divided before the all-reduce
  "train_batch_size": 8,
  "gradient_accumulation_steps": 2,
  "prescale_gradients": true,
  "zero_allow_untested_optimizer": true,
  "dataloader_drop_last": true,
  "optimizer": { "type": "adam", "params": { "lr": 1e-4, "weight_decay": 0.01, "bias_correction": true } },
  "fp16": { "enabled": true, "loss_scale": 0, "initial_scale_power": 16, "auto_cast": false },  # dynamic
  "scheduler": { "type": "WarmupLR", "params": { "warmup_min_lr": 0, "warmup_max_lr": 1e-4, "warmup_num_steps": 10 } },
}"""

ZERO3_NVME = """{
  "train_batch_size": 4,
  "zero_optimization": {
    "stage": 3,
    "allgather_partitions": true,
    "overlap_comm": true,
    "contiguous_gradients": true,
    "sub_group_size": 1e9,
    /* DeepSpeed's names with and without the stage3_ prefix */
    "prefetch_bucket_size": 5e7,
    "stage3_param_persistence_threshold": 1e5,
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_model_persistence_threshold": 1e9,
    "stage3_gather_16bit_weights_on_model_save": true,
    "offload_optimizer": { "device": "nvme", "nvme_path": "/tmp/nvme", "pin_memory": true, "buffer_count": 4 },
    "offload_param": { "device": "nvme", "nvme_path": "/tmp/nvme", "pin_memory": true, "buffer_size": 1e8 }
  },
  "aio": { "block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": false,
           "overlap_events": true, "use_gds": false }
}"""

# (name, config text, what the loaded config holds or the refusal's words, notes expected)
CONFIGS = [
    (
        "Megatron-DeepSpeed MoE template",
        MOE_TEMPLATE.replace("CL", "false"),
        {"zero_optimization.stage": 2, "bf16.enabled": True, "prescale_gradients": False, "wall_clock_breakdown": True},
        [],
    ),
    (
        "MoE template with curriculum learning on",
        MOE_TEMPLATE.replace("CL", "true"),
        {"curriculum_learning.enabled": True, "curriculum_learning.max_difficulty": 64},
        [],
    ),
    (
        "BERT fp16 with prescaling and comments",
        BERT_FP16,
        {"prescale_gradients": True, "optimizer.type": "Adam", "fp16.enabled": True, "scheduler.type": "WarmupLR"},
        ["zero_allow_untested_optimizer", "dataloader_drop_last", "fp16.auto_cast"],
    ),
    (
        "ZeRO-3 on NVMe with stage3_ spellings",
        ZERO3_NVME.replace('"thread_count": 1, ', ""),
        {
            "zero_optimization.stage3_prefetch_bucket_size": 50_000_000,
            "zero_optimization.stage3_gather_16bit_weights_on_model_save": True,
            "zero_optimization.offload_param.device": "nvme",
            "aio.use_gds": False,
        },
        [
            "zero_optimization.allgather_partitions",
            "zero_optimization.stage3_max_reuse_distance",
            "zero_optimization.stage3_model_persistence_threshold",
        ],
    ),
    ("a key DeepSpeed does not read either", ZERO3_NVME, r"unknown key 'aio.thread_count'", []),
    (
        "legacy cpu_offload and bfloat16",
        '{"train_batch_size": 4, "bfloat16": {"enabled": true},'
        ' "zero_optimization": {"stage": 2, "cpu_offload": true, "cpu_offload_use_pin_memory": true}}',
        {"bf16.enabled": True, "zero_optimization.offload_optimizer.device": "cpu"},
        ["zero_optimization.cpu_offload_use_pin_memory"],
    ),
    (
        "legacy cpu_offload_param",
        '{"train_batch_size": 4, "zero_optimization": {"stage": 3, "cpu_offload": true, "cpu_offload_param": true}}',
        {"zero_optimization.offload_param.device": "cpu", "zero_optimization.offload_optimizer.device": "cpu"},
        [],
    ),
    (
        "cpu_offload beside offload_optimizer",
        '{"train_batch_size": 4, "zero_optimization": {"stage": 2, "cpu_offload": true, "offload_optimizer": {"device": "cpu"}}}',
        "cpu_offload is the old spelling of offload_optimizer; give only offload_optimizer",
        [],
    ),
    (
        "boolean zero_optimization",
        '{"train_batch_size": 4, "zero_optimization": true, "allgather_size": 2e8, "disable_allgather": true}',
        {"zero_optimization.stage": 1, "zero_optimization.allgather_bucket_size": 200_000_000},
        ["disable_allgather"],
    ),
    (
        "activation checkpointing and summed gradients",
        '{"train_batch_size": 4, "gradient_allreduce_op": "SUM", "gradient_predivide_factor": 2.0,'
        ' "activation_checkpointing": {"partition_activations": true, "contiguous_memory_optimization": false,'
        ' "cpu_checkpointing": false, "number_checkpoints": 4, "synchronize_checkpoint_boundary": false, "profile": false}}',
        {"gradient_allreduce_op": "sum", "gradient_predivide_factor": 2.0},
        ["activation_checkpointing"]
        + [
            f"activation_checkpointing.{key}"
            for key in (
                "partition_activations",
                "contiguous_memory_optimization",
                "cpu_checkpointing",
                "number_checkpoints",
                "synchronize_checkpoint_boundary",
                "profile",
            )
        ],
    ),
    (
        "a bad activation_checkpointing value",
        '{"train_batch_size": 4, "activation_checkpointing": {"profile": "no"}}',
        r"'activation_checkpointing.profile' .* valid boolean",
        [],
    ),
    (
        "data efficiency off",
        '{"train_batch_size": 4, "data_efficiency": {"enabled": false, "seed": 1234,'
        ' "data_routing": {"enabled": false, "random_ltd": {"enabled": false}}}}',
        {},
        ["data_efficiency"],
    ),
    (
        "data efficiency's umbrella on, both features off (Megatron-DeepSpeed's baseline templates)",
        '{"train_batch_size": 4, "data_efficiency": {"enabled": true, "seed": 1234,'
        ' "data_routing": {"enabled": true, "random_ltd": {"enabled": false}},'
        ' "data_sampling": {"enabled": true, "num_workers": 0, "curriculum_learning": {"enabled": false}}}}',
        {},
        ["data_efficiency"],
    ),
    (
        "curriculum sampling on without metrics",
        '{"train_batch_size": 4, "data_efficiency": {"enabled": true,'
        ' "data_sampling": {"enabled": true, "curriculum_learning": {"enabled": true}}}}',
        "curriculum_learning needs curriculum_metrics when enabled; name at least one metric",
        [],
    ),
    (
        "a schedule-based curriculum metric without its index",
        '{"train_batch_size": 4, "data_efficiency": {"enabled": true, "data_sampling": {"enabled": true,'
        ' "curriculum_learning": {"enabled": true, "curriculum_metrics": {"vocabularyrarity": {'
        '"difficulty_type": "value", "clustering_type": "schedule_based", "min_difficulty": 1,'
        ' "max_difficulty": 100, "schedule_type": "fixed_linear",'
        ' "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 1}}}}}}}',
        "curriculum metric vocabularyrarity is schedule_based by value and needs index_to_sample_path",
        [],
    ),
    (
        "DeepSpeed's loader workers",
        '{"train_batch_size": 4, "data_efficiency": {"data_sampling": {"num_workers": 2}}}',
        "num_workers 2: the data loader's workers are --num-workers here; set it 0 or drop it",
        [],
    ),
    (
        "seqlen_reshape",
        '{"train_batch_size": 4, "data_efficiency": {"enabled": true, "data_sampling": {"enabled": true,'
        ' "curriculum_learning": {"enabled": true, "curriculum_metrics": {"seqlen_reshape": {'
        '"difficulty_type": "value", "clustering_type": "single_cluster", "min_difficulty": 8,'
        ' "max_difficulty": 64, "schedule_type": "fixed_linear",'
        ' "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}}}}}}}',
        "curriculum metric seqlen_reshape .* is not built; use seqlen_truncate",
        [],
    ),
    (
        "curriculum sampling on under an umbrella turned off",
        '{"train_batch_size": 4, "data_efficiency": {"enabled": true, "data_sampling": {"enabled": false,'
        ' "curriculum_learning": {"enabled": true, "curriculum_metrics": {"seqlen_truncate": {'
        '"difficulty_type": "value", "clustering_type": "single_cluster", "min_difficulty": 8,'
        ' "max_difficulty": 64, "schedule_type": "fixed_linear",'
        ' "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}}}}}}}',
        "curriculum_learning.enabled is true under a data_efficiency or data_sampling block with enabled false",
        [],
    ),
    (
        "an optimizer's max_grad_norm",
        '{"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}}',
        "max_grad_norm is not an optimizer parameter; clip with the top-level gradient_clipping key instead",
        [],
    ),
    (
        "random-LTD on without its layers",
        '{"train_batch_size": 4, "data_efficiency": {"enabled": true,'
        ' "data_routing": {"enabled": true, "random_ltd": {"enabled": true}}}}',
        "random_ltd needs random_ltd_layer_id and random_ltd_schedule when enabled",
        [],
    ),
    (
        "random-LTD on under an umbrella turned off",
        '{"train_batch_size": 4, "data_efficiency": {"enabled": false, "data_routing": {"enabled": true,'
        ' "random_ltd": {"enabled": true, "random_ltd_layer_id": [1],'
        ' "random_ltd_schedule": {"min_value": 8, "max_value": 16,'
        ' "schedule_config": {"require_steps": 10, "seq_per_step": 8}}}}}}',
        "random_ltd.enabled is true under a data_efficiency or data_routing block with enabled false",
        [],
    ),
    (
        "compression off",
        '{"train_batch_size": 4, "compression_training": {"weight_quantization":'
        ' {"shared_parameters": {"enabled": false}}, "sparse_pruning": {"shared_parameters": {"enabled": false}}}}',
        {},
        [],
    ),
    (
        "compression on",
        '{"train_batch_size": 4, "compression_training": {"weight_quantization":'
        ' {"shared_parameters": {"enabled": true}}}}',
        "compression_training in .* turns on the compression library",
        [],
    ),
    (
        "profilers and monitors off",
        '{"train_batch_size": 4, "flops_profiler": {"enabled": false, "profile_step": 1}, "comms_logger": {"enabled": false},'
        ' "wandb": {"enabled": false}, "csv_monitor": {"enabled": false}, "tensorboard": {"enabled": false}}',
        {},
        [],
    ),
    (
        "comms logger on, DeepSpeed's tutorial block",
        '{"train_batch_size": 4, "comms_logger": {"enabled": true, "verbose": false, "prof_all": false,'
        ' "prof_ops": ["all_reduce", "all_to_all_single"], "debug": true}}',
        {"comms_logger.enabled": True, "comms_logger.prof_ops": ["all_reduce", "all_to_all_single"]},
        [],
    ),
    (
        "a comms logger key that is not DeepSpeed's",
        '{"train_batch_size": 4, "comms_logger": {"enabled": true, "prof_al": true}}',
        "comms_logger.prof_al",
        [],
    ),
    (
        "a comms logger op that is not an op",
        '{"train_batch_size": 4, "comms_logger": {"enabled": true, "prof_ops": ["allreduce"]}}',
        r"prof_ops names \['allreduce'\], which are not ops",
        [],
    ),
    (
        "wandb on",
        '{"train_batch_size": 4, "wandb": {"enabled": true, "project": "moe"}}',
        "wandb in .* turns on Weights & Biases logging",
        [],
    ),
    (
        "reduction in fp32",
        '{"train_batch_size": 4, "communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"}}',
        {},
        [],
    ),
    (
        "reduction in fp16",
        '{"train_batch_size": 4, "communication_data_type": "fp16"}',
        r"communication_data_type in .* gradient reduction in 16 bits.* set it to \"fp32\"",
        [],
    ),
    (
        "accumulation in bf16",
        '{"train_batch_size": 4, "data_types": {"grad_accum_dtype": "bf16"}}',
        "data_types in .* turns on gradient accumulation or parameters in 16 bits",
        [],
    ),
    (
        "engine blocks without effect",
        '{"train_batch_size": 4, "pipeline": {"activation_checkpoint_interval": 1}, "checkpoint": {"tag_validation": "Warn"},'
        ' "timers": {"throughput": {"enabled": true}}, "compile": {"deepcompile": false}, "log_level": "info"}',
        {},
        ["pipeline", "checkpoint.tag_validation", "timers", "compile", "log_level"],
    ),
    (
        "DeepCompile on",
        '{"train_batch_size": 4, "compile": {"deepcompile": true}}',
        "compile in .* turns on DeepCompile",
        [],
    ),
    ("Ulysses", '{"train_batch_size": 4, "sequence_parallel_size": 2}', "turns on Ulysses sequence parallelism", []),
    (
        "data-first expert groups",
        '{"train_batch_size": 4, "use_data_before_expert_parallelism": true}',
        "turns on data-parallel-first expert groups",
        [],
    ),
    (
        "ZeRO++",
        '{"train_batch_size": 4, "zero_optimization": {"stage": 3, "zero_quantized_gradients": true}}',
        r"zero_optimization.zero_quantized_gradients in .* ZeRO\+\+ quantized gradients",
        [],
    ),
    (
        "fp16 master weights",
        '{"train_batch_size": 4, "fp16": {"enabled": true, "fp16_master_weights_and_grads": true}}',
        "fp16.fp16_master_weights_and_grads in .* fp16 master weights",
        [],
    ),
    (
        "an optimizer DeepSpeed has and this toolkit not",
        '{"train_batch_size": 4, "optimizer": {"type": "Lion"}}',
        r"bad value 'Lion' for 'optimizer.type'",
        [],
    ),
    (
        "a misspelled key",
        '{"train_batch_size": 4, "prescale_gradient": true}',
        r"unknown key 'prescale_gradient' .* did you mean 'prescale_gradients'\?",
        [],
    ),
    (
        "a misspelled alias's inside",
        '{"train_batch_size": 4, "bfloat16": {"enabeld": true}}',
        r"unknown key 'bfloat16.enabeld' .* did you mean 'enabled'\?",
        [],
    ),
    (
        "a misspelled stage3 spelling",
        '{"train_batch_size": 4, "zero_optimization": {"max_reuse_distanc": 1}}',
        r"did you mean 'max_reuse_distance'\?",
        [],
    ),
    (
        "a bad averaging",
        '{"train_batch_size": 4, "gradient_allreduce_op": "max"}',
        r"'gradient_allreduce_op' .* 'mean' or 'sum'",
        [],
    ),
    (
        "a key twice",
        '{"train_batch_size": 4, "fp16": {"enabled": true, "enabled": false}}',
        "key 'enabled' appears twice in one block; keep one of them",
        [],
    ),
    (
        "hjson: unquoted keys and strings, line breaks for commas (DeepSpeed reads its configs with hjson)",
        "# a comment\n{\n  train_batch_size: 4\n  optimizer: {\n    type: Lamb\n    params: {lr: 2e-3, betas: [0.9, 0.95]}\n"
        "  }\n  /* block */ fp16: {enabled: false}\n}\n",
        {"train_batch_size": 4, "optimizer.type": "Lamb", "optimizer.params.lr": 2e-3},
        [],
    ),
    (
        "hjson without its root braces",
        "train_batch_size: 4\nsteps_per_print: 7\n",
        {"train_batch_size": 4, "steps_per_print": 7},
        [],
    ),
    (
        "neither JSON nor Hjson",
        "{train_batch_size: 4\n  optimizer: {type: Adam}\n",
        r"cannot read the runtime config .*: expected a key at line 3 column 1; it must be JSON or Hjson",
        [],
    ),
    (
        "a key twice in Hjson",
        "{\n  train_batch_size: 4\n  train_batch_size: 8\n}",
        "key 'train_batch_size' appears twice in one block; keep one of them",
        [],
    ),
]


def _get(config: RuntimeConfig, dotted: str):
    value = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize("name, text, expected, notes", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_real_world_configs_load_or_stop_with_one_sentence(tmp_path, name, text, expected, notes):
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=expected) as caught:
            load_runtime_config(path, dp_size=1)
        assert "\n" not in str(caught.value)
        return
    config = load_runtime_config(path, dp_size=1)
    for dotted, value in expected.items():
        assert _get(config, dotted) == value, dotted
    noted = [line.split("ds_config ")[1].split(":")[0] for line in no_effect_notes(config)]
    assert sorted(noted) == sorted(notes)


def test_every_hint_and_unbuilt_key_is_a_key_of_the_schema():
    """The tables name keys that the schema accepts (a table entry with a typo would never fire)."""
    for path in [hint.path for hint in HINTS] + [rule.path for rule in UNBUILT]:
        section = RuntimeConfig
        for part in path:
            assert part in section.model_fields, path
            annotation = section.model_fields[part].annotation
            # a section, or an optional one (X | None)
            kinds = [annotation] if isinstance(annotation, type) else list(get_args(annotation))
            section = next((kind for kind in kinds if isinstance(kind, type) and issubclass(kind, BaseModel)), None)


def test_megatron_deepspeed_template_through_the_pretrain_flags(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(MOE_TEMPLATE.replace("CL", "false"))
    flags = (
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --lr 3e-4 --train-iters 10 "
        f"--data-path corpus --num-experts 4 --deepspeed --deepspeed_config {path}"
    ).split()
    config = parse_args(flags)
    assert (
        config.training.global_batch_size,
        config.training.micro_batch_size,
        config.runtime_config(2).precision,
    ) == (16, 2, "bf16")
    runtime = with_data_parallel_size(config, 2).runtime_config(2)
    assert (runtime.zero_optimization.stage, runtime.gradient_accumulation_steps) == (2, 4)


def test_legacy_cpu_offload_builds_the_cpu_optimizer():
    engine = initialize(
        torch.nn.Linear(4, 2), {"train_batch_size": 1, "zero_optimization": {"stage": 1, "cpu_offload": True}}, SINGLE
    )
    assert isinstance(engine.optimizer, CPUAdam)


def test_notes_are_logged_once_by_the_engine(capsys):
    initialize(
        torch.nn.Linear(4, 2),
        {"train_batch_size": 1, "dump_state": True, "zero_allow_untested_optimizer": True},
        SINGLE,
    )
    lines = [line for line in capsys.readouterr().out.splitlines() if "no effect here" in line]
    assert lines == [
        " > ds_config zero_allow_untested_optimizer: accepted, no effect here (ZeRO here partitions the "
        "state of any torch optimizer)",
        " > ds_config dump_state: accepted, no effect here (a DeepSpeed debugging print of its engine's state)",
    ]


AVERAGING = {
    "mean": {},
    "predivide": {"gradient_predivide_factor": 4.0},
    "prescale": {"prescale_gradients": True},
    "sum": {"gradient_allreduce_op": "sum"},
}


def _averaged_step(mode: str, stage: int) -> dict[str, torch.Tensor]:
    """One SGD step (lr 1, so the update is the gradient) over two ranks' different rows."""
    grid = build_parallel_grid(torch.device("cpu"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    start = [p.detach().clone() for p in model.parameters()]
    config = {"train_batch_size": 2, "zero_optimization": {"stage": stage}, **AVERAGING[mode]}
    engine = initialize(model, config, grid, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    x = torch.randn(1, 6, generator=torch.Generator().manual_seed(grid.rank))
    loss = model(x).square().sum()
    local = torch.autograd.grad(loss, list(model.parameters()))[0]
    engine.backward(engine(x).square().sum())
    before_reduction = model[0].weight.grad.detach().clone() if stage == 0 else torch.zeros(0)
    engine.step()
    update = torch.cat([(s - p.detach()).flatten() for s, p in zip(start, model.parameters())])
    return {
        "update": update,
        "local": local,
        "before_reduction": before_reduction,
        "norm": torch.tensor(engine.last_grad_norm),
    }


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_gradient_averaging_modes_follow_deepspeed(stage):
    """mean, predivide and prescale all give the mean over ranks (they differ only in where the
    division happens); "sum" gives the sum. Before the all-reduce the gradients are divided by the
    predivide factor, or by the data-parallel size when prescaling."""
    results = {mode: run_distributed(_averaged_step, 2, mode, stage) for mode in AVERAGING}
    mean = results["mean"][0]
    for mode in ("predivide", "prescale"):
        torch.testing.assert_close(results[mode][0]["update"], mean["update"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(results["sum"][0]["update"], 2 * mean["update"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(results["sum"][0]["norm"], 2 * mean["norm"])
    expected_mean = (results["mean"][0]["local"] + results["mean"][1]["local"]) / 2
    torch.testing.assert_close(mean["update"][: expected_mean.numel()], expected_mean.flatten(), rtol=1e-6, atol=1e-7)
    if stage == 0:
        for mode, divisor in (("mean", 1.0), ("predivide", 4.0), ("prescale", 2.0), ("sum", 1.0)):
            rank0 = results[mode][0]
            torch.testing.assert_close(rank0["before_reduction"], rank0["local"] / divisor, msg=mode)


def test_save_16bit_model_writes_the_weights_in_the_training_precision(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    engine = initialize(model, {"train_batch_size": 1, "bf16": {"enabled": True}}, SINGLE)
    assert engine.save_16bit_model(tmp_path) is True
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert set(saved) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert saved[name].dtype == torch.bfloat16
        assert torch.equal(saved[name], tensor.to(torch.bfloat16))
    with pytest.raises(ConfigError, match="writes safetensors .* name the file pytorch_model.safetensors"):
        engine.save_16bit_model(tmp_path, "pytorch_model.bin")


def _consolidated(folder: str, gather: bool) -> dict[str, torch.Tensor]:
    """Two ranks, experts split over them, ZeRO-3: the consolidated file, if written."""
    grid = build_parallel_grid(torch.device("cpu"), ep_size=2)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_gather_16bit_weights_on_model_save": gather}
    engine = initialize(Net(True, grid.ep_group), {"train_batch_size": 2, "zero_optimization": zero}, grid)
    written = engine.save_16bit_model(folder, f"gather{int(gather)}.safetensors")
    return {
        "written": torch.tensor(written),
        "exists": torch.tensor((Path(folder) / f"gather{int(gather)}.safetensors").exists()),
    }


def test_zero3_consolidates_every_expert_only_when_asked(tmp_path):
    for gather in (False, True):
        ranks = run_distributed(_consolidated, 2, str(tmp_path), gather)
        assert [bool(r["written"]) for r in ranks] == [gather, gather]
        assert bool(ranks[0]["exists"]) == gather
    saved = load_file(str(tmp_path / "gather1.safetensors"))
    whole = model_entries(Net(True, None), owns_dense=True, owns_experts=True)  # the same weights in one process
    assert set(saved) == set(whole)
    for name, tensor in whole.items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=0, msg=name)


def test_comments_and_trailing_commas_keep_line_numbers(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{\n /* two\n lines */\n "train_batch_size": 4,\n "fp16": {"enabled": true,},\n # done\n}')
    assert load_runtime_config(path, 1).fp16.enabled
    path.write_text('{\n /* two\n lines */\n "train_batch_size": 4,\n "fp16": {"enabled": ]\n}')
    with pytest.raises(ConfigError, match="at line 5 column 22"):
        load_runtime_config(path, 1)
    path.write_text(json.dumps({"train_batch_size": 4, "comment": "a // inside a string stays"}))
    with pytest.raises(ConfigError, match="unknown key 'comment'"):
        load_runtime_config(path, 1)


def test_a_config_passed_as_base64_as_deepspeed_takes_it(tmp_path):
    import base64

    encoded = base64.urlsafe_b64encode(json.dumps({"train_batch_size": 4, "bf16": {"enabled": True}}).encode()).decode()
    assert load_runtime_config(encoded, 2).bf16.enabled
    with pytest.raises(ConfigError, match=r"the runtime config conf/ds\.json does not exist .* check the path"):
        load_runtime_config("conf/ds.json", 1)
    bad = base64.urlsafe_b64encode(b'{"train_batch_size": 4, "fp16": {"enabeld": true}}').decode()
    with pytest.raises(ConfigError, match="unknown key 'fp16.enabeld' in the base64 runtime config"):
        load_runtime_config(bad, 1)


def test_hjson_reads_each_of_its_forms_as_the_hjson_spec_gives_them():
    text = """# DeepSpeed config in Hjson
{
  optimizer: {
    type: Adam   // a quoteless string runs to the line's end, comments included (the spec's rule)
    params: { lr: 1e-3, betas: [0.9, 0.95], eps: 1e-8 }
  }
  name: my run, with commas
  quoted: 'it\\'s "q"'
  note: '''
    two
      lines'''
  list: [
    1
    2.5
    -3e2
  ]
  /* block
  comment */ last: null, flag: true
}
"""
    assert parse_hjson(text) == {
        "optimizer": {
            "type": "Adam   // a quoteless string runs to the line's end, comments included (the spec's rule)",
            "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8},
        },
        "name": "my run, with commas",
        "quoted": 'it\'s "q"',
        "note": "two\n  lines",
        "list": [1, 2.5, -300.0],
        "last": None,
        "flag": True,
    }
    for bad, message in (("{a 1}", "expected ':' after the key 'a' at line 1 column 4"), ('{a: "x}', "not closed")):
        with pytest.raises(HjsonError, match=message):
            parse_hjson(bad)
