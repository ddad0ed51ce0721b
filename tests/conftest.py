import pytest
import torch

# Tests marked `cuda` run only where a GPU exists (benchmarks/gpu_check.sh runs them with -m cuda);
# elsewhere pytest reports them as skipped with this reason.
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: run benchmarks/gpu_check.sh on one"
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(requires_cuda)
