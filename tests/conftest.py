import pytest
import torch

# Tests marked `cuda` run only where a GPU exists (benchmarks/gpu_check.sh runs them with -m cuda);
# elsewhere pytest reports them as skipped with this reason.
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: run benchmarks/gpu_check.sh on one"
)

# Every test module's tier, by the heaviest thing it does (`make test-fast` runs `-m unit`):
# unit: in-process, no process group, no trainer, no subprocess;
# integration: in-process trainers, engines, checkpoints and checkpoint fixtures, DataLoader workers;
# distributed: spawns 2-4 gloo ranks (tests/dist_utils.py) or runs torchrun;
# tools: runs the command-line tools as subprocesses.
TIERS = {
    "unit": """aio_tools arguments model_flags peak_flops checksum config_faults cpu_adam cuda_paths data_integrity
        deepspeed_config flops_profiler gpt_dataset indexed_dataset lr_schedules megatron_lm_data model model_options moe_gating
        package_imports placement resume_schedule schedule_corner_cases token_data_checksum tokenizer transpose_op
        zero_residency""",
    "integration": """checkpoint_faults checkpoint_format1 fast_writer curriculum curriculum_sampling
        data_loader_worker_faults generation hf_import_faults
        load_config_check memory run_end_faults runtime""",
    "distributed": """async_save comms_logger config_inputs deepspeed_keys distill evaluation expert_tensor_parallel hf_interop
        onebit_adam onebit_allreduce onebit_lamb zero_one_adam random_ltd curriculum_pipeline
        long_runs model_size moe_ep_dispatch moe_layer moe_router_options moe_training offload parallel_grid
        pipeline_parallel_training profiler_ranks save_lock swap_integrity tensor_parallel tensor_parallel_model
        tensor_parallel_training timers training upcycling zero""",
    "tools": """aio autotuning data_efficiency_study docs_commands hf_tokenizer_check lr_range_tool plotting
        preemption_with_workers preprocess_inputs preprocess_tools recipes setup thread_choice tool_behaviour""",
}
TIER_OF = {f"test_{name}": tier for tier, names in TIERS.items() for name in names.split()}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(requires_cuda)
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module not in TIER_OF:
            raise pytest.UsageError(f"{module}.py has no tier: add it to TIERS in tests/conftest.py")
        item.add_marker(getattr(pytest.mark, TIER_OF[module]))
