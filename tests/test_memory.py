"""Training memory stays flat: the resident size of a tiny MoE GPT stops growing after its first
iterations (issue 13). The run is benchmarks/memory.py's, in a fresh process, since heap
fragmentation depends on the process's whole history. Without the padding of the experts' rows
(megatron/model/moe/experts.py) this run grew by about 400 MiB from iteration 30 to 200; with it,
by 16-48 MiB (2-core x86-64, glibc 2.36, torch 2.13)."""

import sys

import pytest

from benchmarks.memory import run_child, write_text_corpus
from megatron.model.moe.experts import padded_rows

ITERATIONS, AFTER = 200, 30
MAX_GROWTH_MIB = 128


def test_padded_rows_take_few_sizes_and_little_padding():
    assert [padded_rows(n) for n in (0, 1, 31, 32, 33, 1000, 1024, 1025)] == [0, 1, 31, 32, 34, 1024, 1024, 1088]
    assert len({padded_rows(n) for n in range(513, 1025)}) == 16
    assert all(n <= padded_rows(n) < n * 1.0625 for n in range(1, 5000))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the resident size from /proc")
def test_moe_training_memory_stays_flat(tmp_path):
    run = run_child("moe", write_text_corpus(tmp_path), ITERATIONS)
    rss_mib = [b / 2**20 for b in run["rss_bytes"]]
    growth = max(rss_mib[AFTER:]) - rss_mib[AFTER - 1]
    assert growth < MAX_GROWTH_MIB, (
        f"resident size grew by {growth:.0f} MiB from iteration {AFTER} to {ITERATIONS} "
        f"({rss_mib[AFTER - 1]:.0f} -> {max(rss_mib[AFTER:]):.0f} MiB)"
    )
