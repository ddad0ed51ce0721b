"""The device's peak FLOP/s, the denominator of model FLOPs utilisation (MFU): as the user states it
(--peak-tflops), else the vendor's dense tensor-core figure for common GPUs, else measured.

On a CPU (or a GPU not in the table) the peak is measured by a GEMM probe: square matrix products
in the run's dtype and thread count, the best of a few, about 0.3 s. The result is cached per
machine (the CPU or GPU model, threads, dtype, torch version) in a JSON file under the user's
cache folder, so later runs read it instead of measuring.
"""

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# dense (not sparse) tensor-core peaks, TFLOP/s, from the vendors' data sheets (SXM parts where both exist)
GPU_PEAKS: dict[str, dict[torch.dtype, float]] = {
    "H200": {torch.bfloat16: 989.0, torch.float16: 989.0, torch.float32: 67.0},
    "H100": {torch.bfloat16: 989.0, torch.float16: 989.0, torch.float32: 67.0},
    "A100": {torch.bfloat16: 312.0, torch.float16: 312.0, torch.float32: 19.5},
    "L40S": {torch.bfloat16: 362.0, torch.float16: 362.0, torch.float32: 91.6},
    "A10": {torch.bfloat16: 125.0, torch.float16: 125.0, torch.float32: 31.2},
    "V100": {torch.float16: 125.0, torch.float32: 15.7},
}
PROBE_SIZE = 1024  # the probe's square matrices: large enough for a GEMM kernel's steady rate
PROBE_REPEATS = 5


@dataclass(frozen=True)
class PeakFlops:
    tflops: float
    source: str  # how it was found, for the run's log


def peak_flops(device: torch.device, dtype: torch.dtype, stated_tflops: float | None) -> PeakFlops:
    if stated_tflops is not None:
        return PeakFlops(stated_tflops, "stated by --peak-tflops")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = next((peaks for model, peaks in GPU_PEAKS.items() if model in name), {})
        if dtype in known:
            return PeakFlops(known[dtype], f"the data sheet of the {name} ({dtype})")
    return _measured(device, dtype)


def _machine_key(device: torch.device, dtype: torch.dtype) -> str:
    model = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or _cpu_model()
    return f"{model} | {device.type} | {torch.get_num_threads()} threads | {dtype} | torch {torch.__version__}"


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.machine())


def cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "megatron-moe" / "peak_flops.json"


def _measured(device: torch.device, dtype: torch.dtype) -> PeakFlops:
    key, path = _machine_key(device, dtype), cache_file()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if isinstance(cached, dict) and isinstance(cached.get(key), (int, float)):
        return PeakFlops(float(cached[key]), f"a GEMM probe of this machine, cached in {path}")
    tflops = probe_tflops(device, dtype)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps({**(cached if isinstance(cached, dict) else {}), key: tflops}, indent=1))
        temporary.replace(path)  # runs starting together each write a whole file
    except OSError:
        pass  # a read-only home: measured again next time
    return PeakFlops(tflops, "a GEMM probe of this machine at start-up")


def probe_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """The best TFLOP/s of PROBE_REPEATS square products of PROBE_SIZE in `dtype` on `device`."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(PROBE_SIZE, PROBE_SIZE, generator=generator).to(device, dtype)
    b = torch.randn(PROBE_SIZE, PROBE_SIZE, generator=generator).to(device, dtype)
    torch.mm(a, b)  # first call: kernel selection and warm caches
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - began)
    return 2 * PROBE_SIZE**3 / best / 1e12
