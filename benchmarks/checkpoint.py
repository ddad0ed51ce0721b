"""Cost of the checkpoint checksums: Engine.save_checkpoint with its manifest records (size and
checksum, megatron/checkpoint/checksum.py, taken by the tensor-file writer in a thread while it
writes) against the same save with the writer's BlockSum stubbed out (no checksum; patched here
only), so that the checksum is the only difference; and
Engine.load_checkpoint with verify=True against verify=False. Target: save with / without <= 1.05.

The model is a stack of square nn.Linear layers of about --params parameters (fp32) behind
megatron.runtime.engine.initialize with AdamW, stepped once so that both Adam moments exist: the
checkpoint holds weights and two moments, about 12 bytes a parameter (2.4 GB at 200M).

Variants run interleaved in rounds (the order reversed every other round), each checkpoint deleted
once measured; ratios are medians of per-round ratios. Before every load and cold checksum pass each
file's pages are dropped (fsync, then posix_fadvise DONTNEED) and fincore says whether they left:
the table says whether loads were cold or warm. Every save is also traced per file (finiteness
check, write with its checksum, fsync in the writer's thread) to show where time goes; the table also gives both
saves less their finiteness check (aminmax over every tensor). Also timed: checksum alone over the
files (manifest.file_record) from the page cache, as reading a save back would, and from the disk, as
a verifying load does. The machine's load average is recorded: on a shared machine the per-round
ratios spread widely.

Prints a table and writes JSON (default benchmarks/results/checkpoint.json).
"""

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch

import megatron.checkpoint.save as save_module
import megatron.checkpoint.tensor_file as tensor_file_module
from benchmarks.aio import REPO, fs_type, machine
from megatron.checkpoint.manifest import file_record
from megatron.parallel import single_process_grid
from megatron.runtime.engine import Engine, initialize

LAYERS = 12
RUNTIME = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
SAVES, LOADS = ("save_crc", "save_nocrc"), ("load_verify", "load_noverify")
TARGET = 1.05


def parse_count(text: str) -> int:
    """200M, 1.5G, 5e7 or 200000000."""
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def build_engine(params: int) -> tuple[Engine, int]:
    """LAYERS square Linear layers of about `params` parameters in all, after one AdamW step."""
    hidden = max(64, round((params / LAYERS) ** 0.5 / 64) * 64)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(hidden, hidden) for _ in range(LAYERS)))
    engine = initialize(model, RUNTIME, single_process_grid(torch.device("cpu")))
    engine.backward(engine(torch.randn(1, hidden)).square().mean())
    engine.step()
    return engine, hidden


class NoSum:
    """The writer's BlockSum without the checksum: the same calls, nothing computed."""

    def update(self, data: object) -> None:
        pass

    def hexdigest(self) -> str:
        return ""


class Trace:
    """Start and end (seconds from `start`) of every write and fsync during a save."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def wrap(self, kind: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def traced(target: Any, *args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter() - self.start
            result = function(target, *args, **kwargs)
            name = Path(target).name if isinstance(target, (str, Path)) else f"{len(target)} tensors"
            with self.lock:
                self.events.append(
                    {"kind": kind, "file": name, "start": began, "end": time.perf_counter() - self.start}
                )
            return result

        return traced

    def summary(self, total_s: float, sizes: dict[str, int]) -> dict[str, Any]:
        """Seconds spent in each kind; `tail_s`: from the end of the last tensor write to the end
        of the save (the writer thread finishing the last file, then the manifest and rename)."""

        def spent(kind: str) -> float:
            return sum(e["end"] - e["start"] for e in self.events if e["kind"] == kind)

        writes = [e for e in self.events if e["kind"] == "write"]
        return {
            "check_s": spent("check"),
            "write_s": spent("write"),
            "fsync_s": spent("fsync"),
            "tail_s": total_s - max(e["end"] for e in writes),
            "write_gbps": sum(sizes.get(e["file"], 0) for e in writes) / spent("write") / 1e9,
            "events": sorted(self.events, key=lambda e: e["start"]),
        }


@contextmanager
def traced_save(with_crc: bool) -> Iterator[Trace]:
    """save.py's finiteness checks, writes and fsyncs traced; without `with_crc`, no checksum."""
    trace = Trace()
    with (
        mock.patch.object(tensor_file_module, "BlockSum", tensor_file_module.BlockSum if with_crc else NoSum),
        mock.patch.object(save_module, "first_nonfinite", trace.wrap("check", save_module.first_nonfinite)),
        mock.patch.object(save_module, "save_tensors", trace.wrap("write", save_module.save_tensors)),
        mock.patch.object(save_module, "save_rng_state", trace.wrap("write", save_module.save_rng_state)),
        mock.patch.object(save_module, "fsync_path", trace.wrap("fsync", save_module.fsync_path)),
    ):
        yield trace


def checkpoint_files(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*") if path.is_file())


def drop_cached(folder: Path) -> float | None:
    """Flush every file of `folder` and drop its pages from the page cache; the fraction of its
    bytes still resident afterwards (fincore), None where fincore is missing."""
    for path in checkpoint_files(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if shutil.which("fincore") is None:
        return None
    files = [str(path) for path in checkpoint_files(folder)]
    resident = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", *files], capture_output=True, text=True, check=True
    ).stdout.split()
    return sum(map(int, resident)) / sum(os.stat(path).st_size for path in files)


def timed(function: Callable[[], Any]) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def settle_page_cache() -> None:
    """Every save starts from the same page cache: nothing dirty waiting to be written back and,
    where this process may (root), nothing clean to reclaim either, so that neither variant pays
    for what the other (or the loads and checksum passes after it) left behind."""
    os.sync()
    with contextlib.suppress(OSError):  # not root: the dirty pages at least are gone
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    time.sleep(1.0)


def crc_alone(folder: Path) -> float:
    return timed(lambda: [file_record(path) for path in checkpoint_files(folder)])


def run_variant(engine: Engine, folder: Path, with_crc: bool) -> dict[str, Any]:
    """Save (with or without checksum), then (with checksum) checksum alone warm and cold, then a cold load
    (verifying the checksum checkpoint, not verifying the other); the checkpoint is deleted after."""
    gc.collect()
    settle_page_cache()
    with traced_save(with_crc) as trace:
        save_s = timed(lambda: engine.save_checkpoint(folder, "bench"))
    checkpoint = folder / "bench"
    sizes = {path.name: os.stat(path).st_size for path in checkpoint_files(checkpoint)}
    result = {"save_s": save_s, "bytes": sum(sizes.values()), "files": sizes, "trace": trace.summary(save_s, sizes)}
    if with_crc:
        result["crc_warm_s"] = crc_alone(checkpoint)
        result["resident_before_crc_cold"] = drop_cached(checkpoint)
        result["crc_cold_s"] = crc_alone(checkpoint)
    result["resident_before_load"] = drop_cached(checkpoint)
    result["load_s"] = timed(lambda: engine.load_checkpoint(folder, "bench", verify=with_crc))
    shutil.rmtree(checkpoint)
    return result


def measure(engine: Engine, folder: Path, rounds: int) -> list[dict[str, dict[str, Any]]]:
    per_round = []
    for index in range(rounds):
        results = {}
        for with_crc in (True, False) if index % 2 == 0 else (False, True):
            name = "crc" if with_crc else "nocrc"
            results[name] = run_variant(engine, folder, with_crc)
            r = results[name]
            print(
                f"round {index} {name:>5}: save {r['save_s']:6.2f} s, load ({'verify' if with_crc else 'no verify'}) "
                f"{r['load_s']:6.2f} s"
                + (f", checksum alone warm {r['crc_warm_s']:.2f} s cold {r['crc_cold_s']:.2f} s" if with_crc else ""),
                flush=True,
            )
        per_round.append(results)
    return per_round


def row(
    name: str, times: list[float], size: int, ratios: list[float] | None = None, versus: str = ""
) -> dict[str, Any]:
    median = statistics.median(times)
    return {
        "variant": name,
        "median_s": median,
        "min_s": min(times),
        "max_s": max(times),
        "gbps": size / median / 1e9,
        "ratio": statistics.median(ratios) if ratios else None,
        "ratio_min": min(ratios) if ratios else None,
        "ratio_max": max(ratios) if ratios else None,
        "versus": versus,
        "times_s": times,
    }


def summarise(per_round: list[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    size = per_round[0]["crc"]["bytes"]
    crc, nocrc = [r["crc"] for r in per_round], [r["nocrc"] for r in per_round]

    def times(runs: list[dict[str, Any]], key: str) -> list[float]:
        return [run[key] for run in runs]

    def ratios(key: str) -> list[float]:
        return [a[key] / b[key] for a, b in zip(crc, nocrc)]

    for run in crc + nocrc:  # the save less its finiteness check (aminmax over every tensor)
        run["save_unchecked_s"] = run["save_s"] - run["trace"]["check_s"]
    return [
        row(
            "save, checksum (Engine.save_checkpoint)", times(crc, "save_s"), size, ratios("save_s"), "save, no checksum"
        ),
        row("save, no checksum (BlockSum stubbed)", times(nocrc, "save_s"), size),
        row(
            "  same less finiteness check, checksum",
            times(crc, "save_unchecked_s"),
            size,
            ratios("save_unchecked_s"),
            "same, no checksum",
        ),
        row("  same less finiteness check, no checksum", times(nocrc, "save_unchecked_s"), size),
        row("load, verify=True", times(crc, "load_s"), size, ratios("load_s"), "load, verify=False"),
        row("load, verify=False", times(nocrc, "load_s"), size),
        row(
            "checksum alone, page cache",
            times(crc, "crc_warm_s"),
            size,
            [r["crc_warm_s"] / b["save_s"] for r, b in zip(crc, nocrc)],
            "save, no checksum",
        ),
        row(
            "checksum alone, from disk",
            times(crc, "crc_cold_s"),
            size,
            [r["crc_cold_s"] / b["load_s"] for r, b in zip(crc, nocrc)],
            "load, verify=False",
        ),
    ]


def print_table(rows: list[dict[str, Any]], cold: str) -> None:
    print(f"\n{'variant':<40} {'median s':>8} {'min':>7} {'max':>7} {'GB/s':>6} {'ratio':>6} {'range':>11}  versus")
    for r in rows:
        ratio = f"{r['ratio']:6.3f} {r['ratio_min']:5.3f}-{r['ratio_max']:.3f}  {r['versus']}" if r["ratio"] else ""
        print(f"{r['variant']:<40} {r['median_s']:8.2f} {r['min_s']:7.2f} {r['max_s']:7.2f} {r['gbps']:6.2f} {ratio}")
    for r, what in ((rows[0], "save"), (rows[2], "save less its finiteness check")):
        print(
            f"{what} with / without checksum: {r['ratio']:.3f} (target <= {TARGET}): {'ok' if r['ratio'] <= TARGET else 'SLOW'}"
        )
    print(f"loads were {cold}")


def print_trace(per_round: list[dict[str, dict[str, Any]]]) -> None:
    print(
        f"\n{'save':>6} {'check s':>8} {'write s':>8} {'write GB/s':>11} {'fsync s':>8} {'tail s':>7}"
        "   (medians; check = first_nonfinite; write with its checksum; tail = after the last tensor write)"
    )
    for name in ("crc", "nocrc"):
        traces = [r[name]["trace"] for r in per_round]
        cell = {
            key: statistics.median(t[key] for t in traces)
            for key in ("check_s", "write_s", "write_gbps", "fsync_s", "tail_s")
        }
        print(
            f"{name:>6} {cell['check_s']:8.2f} {cell['write_s']:8.2f} {cell['write_gbps']:11.2f} "
            f"{cell['fsync_s']:8.2f} {cell['tail_s']:7.2f}"
        )
    print("one save (first round, checksum), per file: start-end s")
    for event in per_round[0]["crc"]["trace"]["events"]:
        print(f"  {event['kind']:>6} {event['file']:<32} {event['start']:6.2f}-{event['end']:6.2f}")


def cold_description(per_round: list[dict[str, dict[str, Any]]]) -> tuple[str, float | None]:
    resident = [r[name]["resident_before_load"] for r in per_round for name in ("crc", "nocrc")]
    if None in resident:
        return "cold as far as posix_fadvise(DONTNEED) goes (fincore missing: not checked)", None
    most = max(resident)
    return (
        "cold (page cache dropped, fincore: " if most < 0.01 else "warm (page cache NOT dropped, fincore: "
    ) + f"at most {100 * most:.1f}% resident before a load)", most


def default_folder() -> Path:
    """A fresh folder on the local disk: the system temp dir unless it is a tmpfs (RAM), else beside the repository."""
    base = Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix="checkpoint_bench_", dir=REPO.parent if fs_type(base) == "tmpfs" else base))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=parse_count, default=200_000_000, help="model size, e.g. 200M (default)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each variant once per round")
    parser.add_argument(
        "--dir", type=Path, help="folder for the checkpoints (default: a fresh temp dir on the local disk)"
    )
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks/results/checkpoint.json")
    args = parser.parse_args()
    folder = args.dir or default_folder()
    folder.mkdir(parents=True, exist_ok=True)
    started, machine_info, load_before = time.perf_counter(), machine(folder), os.getloadavg()
    engine, hidden = build_engine(args.params)
    parameters = sum(p.numel() for p in engine.module.parameters())
    print(
        f"{LAYERS} x Linear({hidden}, {hidden}): {parameters:,} fp32 parameters, AdamW after one step; "
        f"checkpoints in {folder} ({fs_type(folder)}), {torch.get_num_threads()} torch threads"
    )
    try:
        per_round = measure(engine, folder, args.rounds)
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    rows = summarise(per_round)
    cold, resident = cold_description(per_round)
    print_table(rows, cold)
    print_trace(per_round)
    size = per_round[0]["crc"]["bytes"]
    io_s = statistics.median(r["nocrc"]["trace"]["write_s"] + r["nocrc"]["trace"]["fsync_s"] for r in per_round)
    print(
        f"checkpoint {size:,} bytes in {len(per_round[0]['crc']['files'])} files; implied disk write throughput: "
        f"{rows[1]['gbps']:.2f} GB/s for the whole save without checksum, {size / io_s / 1e9:.2f} GB/s for its writes and "
        f"fsyncs alone; run took {time.perf_counter() - started:.0f} s; load average {load_before[0]:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after ({os.cpu_count()} CPUs)"
    )
    report = {
        **machine_info,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "torch_threads": torch.get_num_threads(),
        "load_average_before_after": [load_before[0], os.getloadavg()[0]],
        "parameters": parameters,
        "layers": LAYERS,
        "hidden": hidden,
        "runtime_config": RUNTIME,
        "checkpoint_bytes": size,
        "files": per_round[0]["crc"]["files"],
        "rounds": args.rounds,
        "loads": cold,
        "max_resident_before_load": resident,
        "target_save_ratio": TARGET,
        "save_ratio": rows[0]["ratio"],
        "save_unchecked_ratio": rows[2]["ratio"],
        "load_ratio": rows[4]["ratio"],
        "write_fsync_gbps": size / io_s / 1e9,
        "rows": rows,
        "per_round": per_round,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
