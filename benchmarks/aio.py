"""Async-I/O op against fio and dd on one folder, in the same run: reads and writes of 1 GiB and
256 MiB with the default handle and a tuned one, `fio --direct=1 --ioengine=libaio --bs=1M
--iodepth=32`, and `dd bs=1M` with O_DIRECT. The four run interleaved, one pass each per round in
a rotating order, so machine drift hits them alike; each ratio is the median of the per-round ratios.
Target: default handle / fio >= 0.95 for reads and writes. Reads are cold (page cache dropped
before each) where the kernel lets us. Prints a table and writes JSON with machine and date.

The tuned settings come from --aio-json (a file holding an "aio" block) or from a small
ds_nvme_tune sweep run first on the same folder.
"""

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch

from megatron.errors import UserError
from megatron.ops import nvme_tune
from megatron.ops.io_bench import AioSettings, Workload, check_folder, drop_page_cache, format_size, measure, parse_size

REPO = Path(__file__).resolve().parent.parent
TUNE_SWEEP = {"block_size": ["256K", "1M", "4M", "8M"], "queue_depth": [8, 32, 128],
              "intra_op_parallelism": [1, 2], "single_submit": [False], "overlap_events": [False, True]}


def fs_type(path: Path) -> str:
    return subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True).stdout.strip()


def default_folder() -> Path:
    """A fresh folder beside the repository: on its disk, never on a tmpfs /tmp (no O_DIRECT there)."""
    return Path(tempfile.mkdtemp(prefix="aio_bench_", dir=REPO.parent))


def ensure_fio() -> str:
    if shutil.which("fio") is None:
        print("fio is missing: installing it with apt-get", flush=True)
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "fio"], check=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    return subprocess.run(["fio", "--version"], capture_output=True, text=True, check=True).stdout.strip()


def fio_gbps(folder: Path, read: bool, size: int) -> float:
    """One fio pass on its own file in the folder (fio lays the file out untimed before a read)."""
    rw = "read" if read else "write"
    out = subprocess.run(["fio", "--name=aio_bench", f"--directory={folder}", "--filename=fio.bin", "--direct=1",
                          "--ioengine=libaio", "--bs=1M", "--iodepth=32", f"--rw={rw}", f"--size={size}",
                          "--output-format=json"], capture_output=True, text=True, check=True).stdout
    return json.loads(out[out.index("{"):])["jobs"][0][rw]["bw_bytes"] / 1e9


def dd_gbps(folder: Path, read: bool, size: int) -> float:
    path = folder / "dd.bin"
    count = f"count={size >> 20}"
    cmd = (["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"] if read else
           ["dd", "if=/dev/zero", f"of={path}", "bs=1M", count, "oflag=direct"])
    err = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "LC_ALL": "C"}).stderr
    copied, seconds = re.search(r"(\d+) bytes .* copied, ([\d.e+-]+) s", err).groups()
    return int(copied) / float(seconds) / 1e9


def tuned_settings(args: argparse.Namespace, folder: Path) -> AioSettings:
    if args.aio_json is not None:
        block = json.loads(args.aio_json.read_text())
        return AioSettings(**block.get("aio", block))
    sweep = folder / "tune_sweep.json"
    sweep.write_text(json.dumps(TUNE_SWEEP))
    print(f"tuning on {folder} with io_size {args.tune_size}", flush=True)
    summary = nvme_tune.run(["--nvme_dir", str(folder), "--sweep_config", str(sweep), "--io_size", args.tune_size,
                              "--loops", "1", "--flush_page_cache"])
    sweep.unlink()
    return AioSettings(**summary["aio"])


def run_rounds(folder: Path, size: int, read: bool, settings: dict[str, AioSettings], loops: int,
               flush: bool) -> dict[str, Any]:
    """`loops` rounds of one pass each: ours per settings, fio, dd; GB/s medians and per-round ratios."""
    passes: dict[str, Callable[[], float]] = {
        "fio": lambda: fio_gbps(folder, read, size),
        "dd": lambda: dd_gbps(folder, read, size),
    }
    with Workload(folder, size) as workload:
        workload.prepare(read)
        if read:
            dd_gbps(folder, False, size)  # the file dd reads
        for name, s in settings.items():
            passes[name] = lambda s=s: measure(workload, s, read, loops=1, warmup=0)["gbps"]
            measure(workload, s, read, loops=1, warmup=1)  # warm-up, untimed
        gbps: dict[str, list[float]] = {name: [] for name in passes}
        names = list(passes)
        for round_ in range(loops):
            # Rotate the order each round: on a virtual disk, going first or after a given pass shifts speed.
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                if read and flush:
                    drop_page_cache()
                gbps[name].append(passes[name]())
    for name in ("fio.bin", "dd.bin"):
        (folder / name).unlink(missing_ok=True)
    row: dict[str, Any] = {"size": size, "op": "read" if read else "write", "loops_gbps": gbps}
    row.update({f"{name}_gbps": statistics.median(values) for name, values in gbps.items()})
    for name in settings:
        row[f"{name}_over_fio"] = statistics.median(a / b for a, b in zip(gbps[name], gbps["fio"]))
    return row


def machine(folder: Path) -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    source = subprocess.run(["df", "--output=source", str(folder)], capture_output=True, text=True).stdout.split()[-1]
    return {"host": platform.node(), "kernel": platform.release(), "cpu": cpu, "cpus": os.cpu_count(),
            "torch": torch.__version__, "folder": str(folder), "device": source, "filesystem": fs_type(folder)}


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\n| size | op | default GB/s | tuned GB/s | fio GB/s | dd GB/s | default/fio | tuned/fio |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {format_size(r['size'])} | {r['op']} | {r['default_gbps']:.3f} | {r['tuned_gbps']:.3f} | "
              f"{r['fio_gbps']:.3f} | {r['dd_gbps']:.3f} | {r['default_over_fio']:.3f} | {r['tuned_over_fio']:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, help="where the test files go (default: a new folder beside the repo)")
    parser.add_argument("--sizes", nargs="+", default=["1G", "256M"])
    parser.add_argument("--loops", type=int, default=5, help="interleaved rounds per size and direction")
    parser.add_argument("--aio-json", type=Path, help='tuned settings: a JSON file with an "aio" block (skips tuning)')
    parser.add_argument("--tune-size", default="256M", help="io_size of the tuning sweep")
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks/results/aio.json")
    args = parser.parse_args()
    made_folder = args.folder is None
    folder = default_folder() if made_folder else args.folder
    sizes = [parse_size(s) for s in args.sizes]
    try:
        check_folder(folder, max(sizes) * 2)  # ours and fio's (or dd's) file side by side
    except UserError as exc:
        sys.exit(f"error: {exc}")
    if fs_type(folder) == "tmpfs":
        print(f"warning: {folder} is on tmpfs, which has no O_DIRECT: numbers are memory copies", file=sys.stderr)
    info = machine(folder)
    fio = ensure_fio()
    flush = drop_page_cache()
    print("cold reads: page cache dropped before every read pass" if flush else
          "warm reads: cannot drop the page cache here (needs root); O_DIRECT still bypasses it")
    try:
        settings = {"default": AioSettings(), "tuned": tuned_settings(args, folder)}
        print(f"default: {settings['default'].describe()}\ntuned:   {settings['tuned'].describe()}")
        rows = []
        for size in sizes:
            for read in (False, True):
                rows.append(run_rounds(folder, size, read, settings, args.loops, flush))
                row = rows[-1]
                print(f"{format_size(size)} {row['op']}: default/fio {row['default_over_fio']:.3f}", flush=True)
    finally:
        if made_folder:
            shutil.rmtree(folder, ignore_errors=True)
    print_table(rows)
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": info,
              "fio": fio, "cold_reads": flush, "loops": args.loops,
              "settings": {name: asdict(s) for name, s in settings.items()}, "rows": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
