"""One MoE layer on a GPU in bf16 (default E=64, 16k tokens, top-1, h=1024): forward+backward
time with the grouped GEMM (`torch._grouped_mm`) against the looped fallback, and against a dense
MLP of equal active FLOPs, in the same run. Prints a table and writes JSON."""

import argparse
import json
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

from benchmarks.moe_layer import output_and_router_loss
from megatron.model.moe import MoEConfig, MoELayer, grouped_gemm


def time_step(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, steps: int, device: torch.device) -> float:
    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out, loss = output_and_router_loss(layer(x)) if isinstance(layer, MoELayer) else (layer(x), 0.0)
        ((out.float() * grad).sum() + loss).backward()
        layer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--output", default="benchmarks/results/gpu_moe_layer.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    h, f = args.hidden, 4 * args.hidden
    torch.manual_seed(0)
    layer = MoELayer(h, f, args.experts, MoEConfig(topk=args.topk), init_std=0.02, output_init_std=0.01).to(device)
    dense = torch.nn.Sequential(
        torch.nn.Linear(h, args.topk * f), torch.nn.GELU(), torch.nn.Linear(args.topk * f, h)
    ).to(device)
    x = torch.randn(1, args.tokens, h, device=device, requires_grad=True)
    grad = torch.randn(1, args.tokens, h, device=device)
    rows = {
        "grouped": time_step(layer, x, grad, args.steps, device),
        "dense": time_step(dense, x, grad, args.steps, device),
    }
    with mock.patch.object(grouped_gemm, "grouped_mm_runs", return_value=False):
        rows["fallback"] = time_step(layer, x, grad, args.steps, device)
    runs = grouped_gemm.grouped_mm_runs(device.type, torch.bfloat16, h, f)
    print(
        f"bf16 MoE layer, h {h}, E {args.experts}, top-{args.topk}, {args.tokens} tokens on {device}; "
        f"torch._grouped_mm runs here: {runs}"
    )
    print(f"{'implementation':16} {'ms':>8} {'x dense':>8}")
    for name, ms in rows.items():
        print(f"{name:16} {ms:8.2f} {ms / rows['dense']:8.2f}")
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "args": vars(args),
        "grouped_mm_runs": runs,
        "ms": rows,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
