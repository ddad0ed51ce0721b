"""Speed of the token-data checksum (megatron/data/token_checksum.py) against reading alone.

One file of --gigabytes random bytes (default 1.0 GB) is written into a fresh temp folder (under
--folder, default /tmp), fsynced so that no writeback runs while passes are timed, and read once so
that it sits in the page cache (fincore says how much of it does). Each pass reads the whole file in
the checksum's 16 MiB chunks with unbuffered readinto into reused numpy buffers:

  checksum         token_checksum._checksum(path, progress=False): the block sums of
                   megatron/checkpoint/checksum.py, a reader thread filling one buffer while the
                   caller sums the other
  read alone       the same reads into one reused buffer, nothing else: the reference
  CRC-32           zlib.crc32 over each chunk, in the reading thread
  SHA-256          hashlib.sha256 updated with each chunk, in the reading thread
  block sums, no thread   BlockSum.update over each chunk in the reading thread (what the reader
                   thread saves)

The serial variants also time their hashing calls alone ("hash GB/s": the rate of the function
itself, reads excluded). After one untimed warm-up pass of each, the variants run in --rounds
interleaved rounds (default 7), the order reversed every other round. GB/s are medians over the
rounds; each ratio is the median of the per-round ratios of the variant's time to reading alone's in
the same round. The checksum must equal the serial block sums' every pass. The temp folder is
removed at the end. Prints a table and writes JSON (default benchmarks/results/data_checksum.json)
with the machine, its CPU's AVX flags and the date.
"""

import argparse
import hashlib
import json
import os
import platform
import shutil
import ssl
import statistics
import subprocess
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.aio import REPO, machine
from megatron.checkpoint.checksum import BlockSum
from megatron.data import token_checksum

CHUNK_BYTES = token_checksum._CHUNK_BYTES  # 16 MiB, the checksum's own chunk
CPU_FLAGS = ("avx2", "avx512f", "sha_ni")  # sha_ni: SHA-256 in hardware, which OpenSSL uses
BENCH_FILE = "data_checksum_bench.bin"
# name -> label, in the order of the table; "read" is the reference of every ratio
VARIANTS = {
    "checksum": "checksum (token_checksum._checksum)",
    "read": "read alone (readinto, 16 MiB)",
    "crc32": "CRC-32 (zlib.crc32), serial",
    "sha256": "SHA-256 (hashlib.sha256), serial",
    "blocksum_serial": "block sums, no reader thread",
}


def cpu_flags() -> dict[str, bool]:
    line = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    present = set(line.split(":", 1)[-1].split())
    return {flag: flag in present for flag in CPU_FLAGS}


def write_random(path: Path, size: int) -> None:
    """`size` random bytes, written in chunks and fsynced."""
    rng = np.random.default_rng(0)
    with open(path, "wb") as handle:
        left = size
        while left:
            count = min(left, CHUNK_BYTES)
            handle.write(rng.bytes(count))
            left -= count
        handle.flush()
        os.fsync(handle.fileno())


def resident_fraction(path: Path) -> float | None:
    """The fraction of the file's bytes in the page cache (fincore), None where fincore is missing."""
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], capture_output=True, text=True, check=True
    ).stdout
    return min(1.0, int(out.split()[0]) / os.path.getsize(path))  # fincore counts whole pages


def serial_pass(path: Path, buffer: np.ndarray, update: Callable[[np.ndarray], Any] | None) -> dict[str, Any]:
    """One pass reading `path` in CHUNK_BYTES into `buffer`, calling `update` on each chunk in this
    thread: total seconds, seconds inside `update`, and bytes."""
    size, hashing = 0, 0.0
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            if update is not None:
                began = time.perf_counter()
                update(buffer[:count])
                hashing += time.perf_counter() - began
            size += count
    return {"s": time.perf_counter() - start, "hash_s": hashing if update is not None else None, "bytes": size}


def passes(path: Path) -> dict[str, Callable[[], dict[str, Any]]]:
    """Each variant as a function timing one pass; the hashing variants keep their digest."""
    buffer = np.empty(CHUNK_BYTES, dtype=np.uint8)

    def checksum() -> dict[str, Any]:
        start = time.perf_counter()
        size, digest = token_checksum._checksum(str(path), progress=False)
        return {"s": time.perf_counter() - start, "hash_s": None, "bytes": size, "digest": digest}

    def hashed(new: Callable[[], Any], update: Callable[[Any, np.ndarray], Any], digest: Callable[[Any], str]):
        def run() -> dict[str, Any]:
            state = new()
            result = serial_pass(path, buffer, lambda chunk: update(state, chunk))
            return {**result, "digest": digest(state)}

        return run

    def crc_update(state: list[int], chunk: np.ndarray) -> None:
        state[0] = zlib.crc32(chunk, state[0])

    return {
        "checksum": checksum,
        "read": lambda: serial_pass(path, buffer, None),
        "crc32": hashed(lambda: [0], crc_update, lambda state: f"{state[0]:08x}"),
        "sha256": hashed(hashlib.sha256, lambda state, chunk: state.update(chunk), lambda state: state.hexdigest()),
        "blocksum_serial": hashed(BlockSum, lambda state, chunk: state.update(chunk), lambda state: state.hexdigest()),
    }


def check(results: dict[str, dict[str, Any]], size: int) -> None:
    wrong = [name for name, r in results.items() if r["bytes"] != size]
    if wrong:
        raise RuntimeError(f"{', '.join(wrong)} read a different number of bytes than the file's {size}")
    if results["checksum"]["digest"] != results["blocksum_serial"]["digest"]:
        raise RuntimeError("token_checksum._checksum and the serial block sums disagree")


def measure(path: Path, rounds: int) -> list[dict[str, dict[str, Any]]]:
    size, runs = os.path.getsize(path), passes(path)
    check({name: run() for name, run in runs.items()}, size)  # warm-up, untimed
    per_round = []
    for index in range(rounds):
        order = list(runs) if index % 2 == 0 else list(reversed(runs))
        results = {name: runs[name]() for name in order}
        check(results, size)
        per_round.append({name: results[name] for name in runs})
        print(
            f"round {index}: "
            + ", ".join(f"{name} {results[name]['s']:.3f} s" for name in runs)
            + f"; load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    return per_round


def summarise(per_round: list[dict[str, dict[str, Any]]], size: int) -> list[dict[str, Any]]:
    rows = []
    for name, label in VARIANTS.items():
        times = [r[name]["s"] for r in per_round]
        ratios = [r[name]["s"] / r["read"]["s"] for r in per_round]
        hashing = [r[name]["hash_s"] for r in per_round if r[name]["hash_s"] is not None]
        median = statistics.median(times)
        rows.append(
            {
                "variant": name,
                "label": label,
                "median_s": median,
                "min_s": min(times),
                "max_s": max(times),
                "gbps": size / median / 1e9,
                "hash_gbps": size / statistics.median(hashing) / 1e9 if hashing else None,
                "ratio_to_read": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "times_s": times,
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{'variant':<36} {'median s':>8} {'min':>6} {'max':>6} {'GB/s':>6} {'hash GB/s':>9}"
        f" {'/ read alone':>12} {'range':>11}"
    )
    for r in rows:
        hashing = f"{r['hash_gbps']:9.2f}" if r["hash_gbps"] is not None else f"{'-':>9}"
        print(
            f"{r['label']:<36} {r['median_s']:8.3f} {r['min_s']:6.3f} {r['max_s']:6.3f} {r['gbps']:6.2f} {hashing}"
            f" {r['ratio_to_read']:12.3f} {r['ratio_min']:5.3f}-{r['ratio_max']:.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gigabytes", type=float, default=1.0, help="size of the test file in GB (10^9 bytes)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds; each variant once per round")
    parser.add_argument(
        "--folder", type=Path, default=Path("/tmp"), help="where the temp folder for the file goes (default /tmp)"
    )
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks/results/data_checksum.json")
    args = parser.parse_args()
    size = int(args.gigabytes * 1e9)
    args.folder.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="data_checksum_bench_", dir=args.folder))
    started, load_before = time.perf_counter(), os.getloadavg()
    machine_info, flags = machine(folder), cpu_flags()
    path = folder / BENCH_FILE
    try:
        write_random(path, size)
        serial_pass(path, np.empty(CHUNK_BYTES, dtype=np.uint8), None)  # into the page cache
        resident = resident_fraction(path)
        print(
            f"{size:,} random bytes in {path} ({machine_info['filesystem']}), "
            + ("residency not checked (no fincore)" if resident is None else f"{100 * resident:.1f}% in the page cache")
            + f"; {machine_info['cpu']}, {machine_info['cpus']} CPUs, "
            + ", ".join(f"{flag} {'yes' if present else 'no'}" for flag, present in flags.items()),
            flush=True,
        )
        per_round = measure(path, args.rounds)
        resident_after = resident_fraction(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rows = summarise(per_round, size)
    print_table(rows)
    ratio = rows[0]
    print(
        f"checksum / read alone: {ratio['ratio_to_read']:.3f} (per-round range {ratio['ratio_min']:.3f}-"
        f"{ratio['ratio_max']:.3f}); run took {time.perf_counter() - started:.0f} s; load average "
        f"{load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    report = {
        **machine_info,
        "cpu_flags": flags,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "zlib": zlib.ZLIB_RUNTIME_VERSION,
        "openssl": ssl.OPENSSL_VERSION,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "load_average_before_after": [load_before[0], os.getloadavg()[0]],
        "file_bytes": size,
        "chunk_bytes": CHUNK_BYTES,
        "resident_before_after": [resident, resident_after],
        "rounds": args.rounds,
        "checksum_ratio_to_read": ratio["ratio_to_read"],
        "rows": rows,
        "per_round": per_round,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
