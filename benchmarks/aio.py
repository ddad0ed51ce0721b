"""Async-I/O op against the best fio configuration on the same disk, and against DeepSpeed's op.

Reads and writes of 1 GiB and 256 MiB (--sizes), every column on the same file (on a virtual disk the
speed depends on where a file lies and on its history, so separate files would favour one side):

  ours       the default handle (block 1M, queue depth 128, overlap_events off) with
             intra_op_parallelism 1, 2, 4 ... up to the core count (ours_t1, ours_t2, ...), on a
             locked buffer (new_cpu_locked_tensor) and on a plain tensor (torch.empty: not page-aligned,
             what a user passes by default, so every block goes through a bounce copy: ours_t1_plain)
  fio        the best configuration of a sweep run first, in the same session: block size x iodepth
             x numjobs x buffer memory (malloc, and huge pages where the kernel lets us reserve them,
             as our locked buffers have), O_DIRECT libaio, numjobs contiguous shares of the file.
             Every configuration runs once at --sweep-size; the --finalists fastest per direction run
             --sweep-repeats more times, interleaved, at every size; the highest median wins, per size
             and direction
  ours_t1_small_buffer  (reads) a control for fio's buffer: the default handle reading the file as
             async ops of fio's memory footprint (bs x iodepth x numjobs of the best read configuration),
             all into the same locked buffer, as fio reuses its buffer for every request. On a virtual
             disk a small buffer that stays in the caches takes data faster than a tensor the size of the
             read; this column tells that apart from the op's own speed
  deepspeed  DeepSpeed's aio_handle() (its defaults, equal to ours) on its own new_cpu_locked_tensor,
             and on the plain tensor (deepspeed_plain), where deepspeed imports and its JIT-built
             async_io op loads: run this script with DeepSpeed's Python for these columns (deepspeed
             is a benchmark-only dependency); elsewhere they are skipped with a note

Every pass of ours and DeepSpeed's times one async submit and wait of the whole tensor, open and
size checks included; fio reports its own bandwidth. Each round runs one pass of every column in a
rotating order, after one untimed warm-up pass each; GB/s are medians over rounds, and every ratio is
the median of the per-round ratios. The page cache is dropped before every read pass where the
kernel lets us (root), though every side uses O_DIRECT. The 1-minute load average is sampled after
every round. Targets (issue 17): ours locked >= 0.95x best fio, ours plain >= 0.8x ours locked.
Prints the sweep and the tables, and writes JSON with machine and date.
"""

import argparse
import contextlib
import datetime
import errno
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from megatron.errors import UserError
from megatron.ops.io_bench import check_folder, drop_page_cache, fill_pattern, format_size, handle_factory, parse_size

REPO = Path(__file__).resolve().parent.parent
SWEEP_BLOCKS = ("256K", "1M", "4M", "16M")
SWEEP_DEPTHS = (4, 16, 64)
SWEEP_JOBS = (1, 2, 4)
# Bytes in flight over all of fio's jobs: 256 MiB, twice our default handle's 128 MiB; it also bounds
# the huge pages reserved for fio's buffers.
MAX_FIO_IN_FLIGHT = 256 << 20
HUGE_PAGE = 2 << 20
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
UINT8 = torch.empty(0, dtype=torch.uint8)
BENCH_FILE = "aio_bench.bin"

Pass = Callable[[bool, int], float]  # (read, size) -> GB/s of one timed pass


def fs_type(path: Path) -> str:
    return subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True).stdout.strip()


def default_folder() -> Path:
    """A fresh folder beside the repository: on its disk, never on a tmpfs /tmp (no O_DIRECT there)."""
    return Path(tempfile.mkdtemp(prefix="aio_bench_", dir=REPO.parent))


def machine(folder: Path) -> dict[str, Any]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    source = subprocess.run(["df", "--output=source", str(folder)], capture_output=True, text=True).stdout.split()[-1]
    return {
        "host": platform.node(),
        "kernel": platform.release(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "folder": str(folder),
        "device": source,
        "filesystem": fs_type(folder),
    }


def ensure_fio() -> str:
    if shutil.which("fio") is None:
        print("fio is missing: installing it with apt-get", flush=True)
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "fio"],
            check=True,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
    return subprocess.run(["fio", "--version"], capture_output=True, text=True, check=True).stdout.strip()


# -- fio ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FioConfig:
    bs: int
    iodepth: int
    numjobs: int
    hugepages: bool  # buffers in huge pages (--mem=shmhuge), else fio's default malloc

    def label(self) -> str:
        memory = "hugepages" if self.hugepages else "malloc"
        return f"bs={format_size(self.bs)} iodepth={self.iodepth} numjobs={self.numjobs} mem={memory}"


def fio_grid(hugepages: bool, smallest: int) -> list[FioConfig]:
    """Every combination with at most MAX_FIO_IN_FLIGHT bytes in flight and a block per job share."""
    memories = (False, True) if hugepages else (False,)
    return [
        FioConfig(parse_size(bs), depth, jobs, memory)
        for bs in SWEEP_BLOCKS
        for depth in SWEEP_DEPTHS
        for jobs in SWEEP_JOBS
        for memory in memories
        if parse_size(bs) * depth * jobs <= MAX_FIO_IN_FLIGHT and parse_size(bs) * jobs <= smallest
    ]


def fio_gbps(path: Path, config: FioConfig, read: bool, size: int) -> float:
    """One fio pass over the first `size` bytes of `path`, each job on its own contiguous share."""
    rw = "read" if read else "write"
    share = size // config.numjobs
    command = [
        "fio",
        "--name=aio_bench",
        f"--filename={path}",
        "--direct=1",
        "--ioengine=libaio",
        f"--bs={config.bs}",
        f"--iodepth={config.iodepth}",
        f"--numjobs={config.numjobs}",
        f"--size={share}",
        f"--offset_increment={share}",
        f"--rw={rw}",
        "--group_reporting",
        "--output-format=json",
    ]
    if config.hugepages:
        command.append("--mem=shmhuge")
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        raise OSError(errno.EIO, f"fio {config.label()} failed: {run.stderr.strip()[-300:]}", str(path))
    out = run.stdout
    return json.loads(out[out.index("{") :])["jobs"][0][rw]["bw_bytes"] / 1e9


def free_huge_pages() -> int:
    line = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("HugePages_Free"))
    return int(line.split()[1])


@contextlib.contextmanager
def reserved_huge_pages(count: int) -> Iterator[bool]:
    """Reserve `count` more 2 MiB huge pages for fio's buffers while the block runs (needs root) and
    give them back after; yields whether they are there. Our locked buffers get huge pages through
    transparent huge pages; fio can only use reserved ones."""
    try:
        old = int(NR_HUGEPAGES.read_text())
        NR_HUGEPAGES.write_text(f"{old + count}\n")
    except OSError:
        old = None
    try:
        yield old is not None and free_huge_pages() >= count
    finally:
        if old is not None:
            NR_HUGEPAGES.write_text(f"{old}\n")


def fio_timed(path: Path, config: FioConfig, flush: bool, read: bool, size: int) -> float:
    if read and flush:
        drop_page_cache()
    return fio_gbps(path, config, read, size)


def fio_sweep(
    path: Path, sizes: list[int], args: argparse.Namespace, hugepages: bool, flush: bool
) -> tuple[dict[str, Any], dict[tuple[bool, int], FioConfig]]:
    """Per direction: the whole grid once at --sweep-size, then the finalists interleaved at every
    size. Returns the record of every pass and the best configuration per (read, size)."""
    sweep_size = parse_size(args.sweep_size)
    grid = fio_grid(hugepages, min(sizes + [sweep_size]))
    record: dict[str, Any] = {}
    best: dict[tuple[bool, int], FioConfig] = {}
    for read in (False, True):
        op = "read" if read else "write"
        print(f"fio sweep, {op}: {len(grid)} configurations at {args.sweep_size}", flush=True)
        first = {config: fio_timed(path, config, flush, read, sweep_size) for config in grid}
        finalists = sorted(grid, key=first.__getitem__, reverse=True)[: args.finalists]
        reruns: dict[tuple[int, FioConfig], list[float]] = {(s, c): [] for s in sizes for c in finalists}
        for size in sizes:
            for _ in range(args.sweep_repeats):
                for config in finalists:
                    reruns[size, config].append(fio_timed(path, config, flush, read, size))
            best[read, size] = max(finalists, key=lambda c, s=size: statistics.median(reruns[s, c]))
        record[op] = {
            "grid": sorted(
                ({**asdict(c), "label": c.label(), "gbps": g} for c, g in first.items()), key=lambda row: -row["gbps"]
            ),
            "finalists": [{**asdict(c), "label": c.label(), "size": s, "gbps": g} for (s, c), g in reruns.items()],
            "best": {
                format_size(s): {
                    **asdict(best[read, s]),
                    "label": best[read, s].label(),
                    "gbps": statistics.median(reruns[s, best[read, s]]),
                }
                for s in sizes
            },
        }
    return record, best


# -- ours and DeepSpeed's ----------------------------------------------------------------------------
def timed_pass(handle: Any, buffer: torch.Tensor, path: Path, read: bool) -> float:
    """GB/s of one async submit + wait of the whole buffer; works for both handles."""
    submit = handle.async_pread if read else handle.async_pwrite
    start = time.perf_counter()
    queued = submit(buffer, str(path))
    completed = handle.wait()
    seconds = time.perf_counter() - start
    if queued != 0 or completed != 1:  # DeepSpeed's handle reports failures as return codes
        raise OSError(
            errno.EIO,
            f"{'reading' if read else 'writing'} {buffer.numel()} bytes failed (submit "
            f"returned {queued}, wait {completed})",
            str(path),
        )
    return buffer.numel() / seconds / 1e9


def handle_timed(handle: Any, buffer: torch.Tensor, path: Path, flush: bool, read: bool, size: int) -> float:
    if read and flush:
        drop_page_cache()
    return timed_pass(handle, buffer[:size], path, read)


def thread_counts(cores: int) -> list[int]:
    """1, 2, 4 ... and the core count itself."""
    counts = {cores}
    count = 1
    while count < cores:
        counts.add(count)
        count *= 2
    return sorted(counts)


def filled_buffer(buffer: torch.Tensor) -> torch.Tensor:
    fill_pattern(buffer)
    return buffer


def small_buffer_timed(
    handle: Any, buffer: torch.Tensor, path: Path, flush: bool, piece: int, read: bool, size: int
) -> float:
    """GB/s of our op reading `size` bytes of the file as async ops of `piece` bytes, all into the same
    buffer: fio's memory footprint (bs x iodepth x numjobs, reused for every request). The control
    for fio's reads, which land in a buffer small enough to stay in the CPU caches."""
    if read and flush:
        drop_page_cache()
    start = time.perf_counter()
    for offset in range(0, size, piece):
        handle.async_pread(buffer[: min(piece, size - offset)], str(path), offset)
    handle.wait()
    return size / (time.perf_counter() - start) / 1e9


def ours_passes(
    path: Path, size: int, threads: list[int], plain: torch.Tensor, flush: bool
) -> tuple[dict[str, Pass], Callable[[int], Pass]]:
    """Every column of ours, and the small-buffer control for a given piece size."""
    aio_handle = handle_factory()
    handles = {t: aio_handle(intra_op_parallelism=t) for t in threads}
    locked = filled_buffer(handles[threads[0]].new_cpu_locked_tensor(size, UINT8))
    passes = {}
    for t, handle in handles.items():
        passes[f"ours_t{t}"] = functools.partial(handle_timed, handle, locked, path, flush)
        passes[f"ours_t{t}_plain"] = functools.partial(handle_timed, handle, plain, path, flush)
    return passes, lambda piece: functools.partial(small_buffer_timed, handles[threads[0]], locked, path, flush, piece)


def load_deepspeed() -> tuple[Any, str]:
    """DeepSpeed's async_io module and its version, or None and why its columns are skipped."""
    try:
        import deepspeed
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError as exc:
        return None, (
            f"DeepSpeed is not importable here ({exc}): its columns are skipped; run this script "
            "with a Python that has deepspeed installed"
        )
    try:
        return AsyncIOBuilder().load(verbose=False), deepspeed.__version__
    except Exception as exc:  # a JIT build fails in many ways: no compiler, no libaio-dev, ...
        return None, (
            f"DeepSpeed {deepspeed.__version__}'s async_io op could not be built ({type(exc).__name__}: "
            f"{exc}): its columns are skipped; it needs libaio-dev and a C++ compiler"
        )


def deepspeed_passes(module: Any, path: Path, size: int, plain: torch.Tensor, flush: bool) -> dict[str, Pass]:
    handle = module.aio_handle()
    locked = filled_buffer(handle.new_cpu_locked_tensor(size, UINT8))
    return {
        "deepspeed": functools.partial(handle_timed, handle, locked, path, flush),
        "deepspeed_plain": functools.partial(handle_timed, handle, plain, path, flush),
    }


# -- rounds ------------------------------------------------------------------------------------------
def ratio_pairs(names: list[str], threads: list[int]) -> dict[str, tuple[str, str]]:
    pairs = {}
    for t in threads:
        pairs[f"ours_t{t}/fio"] = (f"ours_t{t}", "fio")
        pairs[f"ours_t{t}_plain/ours_t{t}"] = (f"ours_t{t}_plain", f"ours_t{t}")
    if "ours_t1_small_buffer" in names:
        pairs["ours_t1_small_buffer/fio"] = ("ours_t1_small_buffer", "fio")
    if "deepspeed" in names:
        pairs["ours_t1/deepspeed"] = ("ours_t1", "deepspeed")
        pairs["ours_t1_plain/deepspeed_plain"] = ("ours_t1_plain", "deepspeed_plain")
    return pairs


def run_rounds(
    passes: dict[str, Pass], size: int, read: bool, loops: int, threads: list[int], loads: list[float]
) -> dict[str, Any]:
    """`loops` rounds of one pass per column, in an order that rotates every round."""
    for run in passes.values():
        run(read, size)  # warm-up, untimed; the first write lays out each side's file
    gbps: dict[str, list[float]] = {name: [] for name in passes}
    names = list(passes)
    for round_ in range(loops):
        # Rotate the order: on a virtual disk, going first or after a given pass shifts speed.
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            gbps[name].append(passes[name](read, size))
        loads.append(os.getloadavg()[0])
    row: dict[str, Any] = {
        "size": size,
        "op": "read" if read else "write",
        "loops_gbps": gbps,
        "gbps": {name: statistics.median(values) for name, values in gbps.items()},
    }
    row["ratios"] = {
        label: statistics.median(x / y for x, y in zip(gbps[a], gbps[b]))
        for label, (a, b) in ratio_pairs(names, threads).items()
    }
    return row


# -- output ------------------------------------------------------------------------------------------
def print_sweep(sweep: dict[str, Any], top: int) -> None:
    for op, result in sweep.items():
        print(f"\nfio sweep, {op}: the {top} fastest of {len(result['grid'])} single passes")
        print("| configuration | GB/s |\n| --- | ---: |")
        for row in result["grid"][:top]:
            print(f"| {row['label']} | {row['gbps']:.3f} |")
        print("finalists (median of the reruns per size):")
        for row in result["finalists"]:
            print(f"  {format_size(row['size'])} {row['label']}: {statistics.median(row['gbps']):.3f} GB/s")
        for size, best in result["best"].items():
            print(f"best {op} at {size}: {best['label']} ({best['gbps']:.3f} GB/s)")


def print_table(rows: list[dict[str, Any]], key: str, fmt: str) -> None:
    columns = list(dict.fromkeys(column for row in rows for column in row[key]))
    print("\n| size | op | " + " | ".join(columns) + " |")
    print("| --- | --- |" + " ---: |" * len(columns))
    for row in rows:
        cells = " | ".join(format(row[key][c], fmt) if c in row[key] else "-" for c in columns)
        print(f"| {format_size(row['size'])} | {row['op']} | {cells} |")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--folder", type=Path, help="where the test file goes, removed after (default: a new folder beside the repo)"
    )
    parser.add_argument("--sizes", nargs="+", default=["1G", "256M"])
    parser.add_argument("--loops", type=int, default=7, help="interleaved rounds per size and direction")
    parser.add_argument("--sweep-size", default="256M", help="bytes per pass of the fio grid")
    parser.add_argument("--finalists", type=int, default=3, help="fio configurations rerun per direction")
    parser.add_argument("--sweep-repeats", type=int, default=3, help="reruns of each finalist per size")
    parser.add_argument(
        "--no-fio-hugepages",
        action="store_true",
        help="do not reserve huge pages for fio's buffers (the sweep then has malloc only)",
    )
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks/results/aio.json")
    return parser.parse_args()


def prepare_file(path: Path, size: int) -> None:
    """The file every column uses, written once by our op so that fio's first read pass has data."""
    handle = handle_factory()()
    buffer = filled_buffer(handle.new_cpu_locked_tensor(size, UINT8))
    handle.sync_pwrite(buffer, str(path))


def measure_all(
    folder: Path, sizes: list[int], args: argparse.Namespace, flush: bool, hugepages: bool
) -> dict[str, Any]:
    threads = thread_counts(os.cpu_count() or 1)
    deepspeed_module, deepspeed_note = load_deepspeed()
    if deepspeed_module is None:
        print(f"note: {deepspeed_note}", flush=True)
    path = folder / BENCH_FILE
    prepare_file(path, max(sizes))
    sweep, best = fio_sweep(path, sizes, args, hugepages, flush)
    plain = filled_buffer(torch.empty(max(sizes), dtype=torch.uint8))
    passes, small_buffer = ours_passes(path, max(sizes), threads, plain, flush)
    if deepspeed_module is not None:
        passes.update(deepspeed_passes(deepspeed_module, path, max(sizes), plain, flush))
    rows, loads = [], [os.getloadavg()[0]]
    for size in sizes:
        for read in (False, True):
            config = best[read, size]
            columns = {**passes, "fio": functools.partial(fio_timed, path, config, flush)}
            if read:
                footprint = min(size, max(config.bs * config.iodepth * config.numjobs, 1 << 20))
                columns["ours_t1_small_buffer"] = small_buffer(footprint)
            row = run_rounds(columns, size, read, args.loops, threads, loads)
            row["fio"] = best[read, size].label()
            rows.append(row)
            ratios = ", ".join(f"{k} {v:.2f}" for k, v in row["ratios"].items())
            print(f"{format_size(size)} {row['op']}: {ratios}", flush=True)
    return {
        "threads": threads,
        "fio_hugepages": hugepages,
        "sweep": sweep,
        "rows": rows,
        "load_average_1min": loads,
        "deepspeed": deepspeed_note if deepspeed_module is None else f"DeepSpeed {deepspeed_note}",
    }


def main() -> None:
    args = parse_args()
    made_folder = args.folder is None
    folder = default_folder() if made_folder else args.folder
    sizes = [parse_size(s) for s in args.sizes]
    try:
        check_folder(folder, max(sizes))
    except UserError as exc:
        sys.exit(f"error: {exc}")
    if fs_type(folder) == "tmpfs":
        print(f"warning: {folder} is on tmpfs, which has no O_DIRECT: numbers are memory copies", file=sys.stderr)
    info, fio = machine(folder), ensure_fio()
    flush = drop_page_cache()
    print(
        "cold reads: page cache dropped before every read pass"
        if flush
        else "warm reads: cannot drop the page cache here (needs root); O_DIRECT still bypasses it"
    )
    started = datetime.datetime.now().isoformat(timespec="seconds")
    pages = 0 if args.no_fio_hugepages else MAX_FIO_IN_FLIGHT // HUGE_PAGE + 4 * max(SWEEP_JOBS)
    try:
        with reserved_huge_pages(pages) as hugepages:
            if not hugepages:
                print(
                    "note: no huge pages reserved for fio (needs root, or --no-fio-hugepages): fio sweeps malloc "
                    "buffers only",
                    flush=True,
                )
            result = measure_all(folder, sizes, args, flush, hugepages)
    finally:
        if made_folder:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            (folder / BENCH_FILE).unlink(missing_ok=True)
    print_sweep(result["sweep"], top=10)
    print(f"\n{result['deepspeed']}\nGB/s (medians of {args.loops} interleaved rounds):")
    print_table(result["rows"], "gbps", ".3f")
    print("\nratios (medians of per-round ratios):")
    print_table(result["rows"], "ratios", ".2f")
    loads = result["load_average_1min"]
    print(f"\n1-minute load average during the run: {min(loads):.2f}-{max(loads):.2f}")
    report = {"date": started, "machine": info, "fio": fio, "cold_reads": flush, "loops": args.loops, **result}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
