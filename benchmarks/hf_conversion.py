"""Hugging Face conversion throughput (issue 15): a 1B-parameter Llama-shaped model converted
from a Hugging Face folder into a checkpoint of ours (`--from hf`) and back (`--to hf`), against a
plain copy of the same files on the same disk in the same round (flushed with sync, as the
converters flush theirs), as a ratio. Times are whole processes, imports included.

The Hugging Face folder is written first with random fp32 weights, one layer per safetensors
shard, so building it needs no more than a layer in memory. Each conversion and each copy runs in
a fresh process, which reports its wall time and peak RSS; the page cache is dropped before each
(where /proc/sys/vm/drop_caches is writable) so every run reads from the disk. Rounds interleave
the three; the table holds medians. Prints a table and writes JSON (default
benchmarks/results/hf_conversion.json).

    python -m benchmarks.hf_conversion [--layers 20] [--rounds 3] [--work-dir /tmp/hf_conversion]
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 2048, 5632, 16, 4, 32000


def layer_tensors(index: int) -> dict:
    import torch

    head_dim = HIDDEN // HEADS
    prefix = f"model.layers.{index}."
    shapes = {
        "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
        "self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
        "self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
        "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
        "mlp.gate_proj.weight": (FFN, HIDDEN),
        "mlp.up_proj.weight": (FFN, HIDDEN),
        "mlp.down_proj.weight": (HIDDEN, FFN),
        "input_layernorm.weight": (HIDDEN,),
        "post_attention_layernorm.weight": (HIDDEN,),
    }
    return {prefix + name: torch.randn(shape) * 0.02 for name, shape in shapes.items()}


def write_hf_model(folder: Path, layers: int) -> int:
    """A Llama folder as save_pretrained writes it (config, index, shards); returns its weight bytes."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    shards = [{"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN) * 0.02}]
    shards += [layer_tensors(i) for i in range(layers)]
    shards.append({"model.norm.weight": torch.ones(HIDDEN), "lm_head.weight": torch.randn(VOCAB, HIDDEN) * 0.02})
    weight_map, total = {}, 0
    for n, tensors in enumerate(shards, start=1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return total


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed_child(command: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (GiB) of a fresh process running `command`."""
    with open(os.devnull, "w") as quiet, tempfile.TemporaryFile("w+") as errors:
        start = time.perf_counter()
        child = subprocess.Popen(command, stdout=quiet, stderr=errors)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage
        seconds = time.perf_counter() - start
        if status:
            errors.seek(0)
            sys.exit(f"error: {' '.join(command)} failed:\n{errors.read()[-3000:]}")
    return seconds, usage.ru_maxrss / 2**20  # KiB -> GiB


def convert(args: list[str]) -> list[str]:
    return [sys.executable, "tools/checkpoint/convert.py", *args]


def copy_folder(source: Path, target: Path) -> list[str]:
    """A copy flushed to the disk, as the converters' files are."""
    return [sys.executable, "-c", f"import os, shutil; shutil.copytree({str(source)!r}, {str(target)!r}); os.sync()"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=20, help="20 Llama layers of width 2048: 1.03B parameters")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/hf_conversion"))
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/hf_conversion.json"))
    parser.add_argument("--write-hf", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_hf is not None:  # the child that writes the model folder
        print(write_hf_model(args.write_hf, args.layers))
        return
    # Linux carries a process's peak RSS over fork and exec into its children, so this process
    # stays small (no torch, no tensors) and a child writes the model folder
    shutil.rmtree(args.work_dir, ignore_errors=True)
    hf = args.work_dir / "hf"
    written = subprocess.run(
        [sys.executable, "-m", "benchmarks.hf_conversion", "--write-hf", str(hf), "--layers", str(args.layers)],
        capture_output=True,
        text=True,
        check=True,
    )
    total = int(written.stdout.split()[-1])
    parameters = total // 4
    print(f"Hugging Face Llama folder: {parameters / 1e9:.2f}B parameters, {total / 1e9:.2f} GB of fp32 weights")
    cases = {
        "copy (reference)": lambda r: copy_folder(hf, args.work_dir / f"copy{r}"),
        "--from hf (HF -> ours)": lambda r: convert(
            ["--from", "hf", "--load", str(hf), "--save", str(args.work_dir / f"ours{r}")]
        ),
        "--to hf (ours -> HF)": lambda r: convert(
            ["--to", "hf", "--load", str(args.work_dir / f"ours{r}"), "--save", str(args.work_dir / f"back{r}")]
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    peaks: dict[str, float] = {}
    dropped = True
    for r in range(args.rounds):
        for name, command in cases.items():
            dropped = drop_page_cache() and dropped
            seconds, peak = timed_child(command(r))
            times[name].append(seconds)
            peaks[name] = max(peak, peaks.get(name, 0.0))
        for folder in ("copy", "back"):
            shutil.rmtree(args.work_dir / f"{folder}{r}", ignore_errors=True)
        if r:
            shutil.rmtree(args.work_dir / f"ours{r - 1}", ignore_errors=True)
    copy = statistics.median(times["copy (reference)"])
    rows = []
    for name, values in times.items():
        seconds = statistics.median(values)
        rows.append({"case": name, "seconds": seconds, "gb_per_s": total / seconds / 1e9, "of_copy": copy / seconds})
    print(f"\n{'case':<26} {'s (median)':>10} {'GB/s':>7} {'x copy':>7}")
    for row in rows:
        print(f"{row['case']:<26} {row['seconds']:>10.2f} {row['gb_per_s']:>7.2f} {row['of_copy']:>7.2f}")
    print(
        "peak RSS (GiB): "
        + ", ".join(f"{name} {peak:.2f}" for name, peak in peaks.items())
        + f"; page cache dropped: {dropped}"
    )
    import torch

    from benchmarks.moe_layer import cpu_name

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d"),
                "machine": cpu_name(),
                "platform": platform.platform(),
                "torch": torch.__version__,
                "load_average": os.getloadavg(),
                "parameters": parameters,
                "bytes": total,
                "rounds": args.rounds,
                "page_cache_dropped": dropped,
                "peak_rss_gib": peaks,
                "rows": rows,
                "times": times,
            },
            indent=1,
        )
    )
    shutil.rmtree(args.work_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
