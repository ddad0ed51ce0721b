"""`ds_nvme_tune`: sweep the async-I/O handle's settings on one folder and print the fastest as the
"aio" block of a DeepSpeed-style config.

Every combination of the sweep lists is timed for reads and writes of --io_size bytes on one
file (written once for all the read runs). The "aio" block is the combination with the highest
read + write GB/s, since the runtime uses one handle for both directions.
"""

import argparse
import itertools
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from tqdm import tqdm

from megatron.config.parser import FlagParser, positive_int
from megatron.entry_point import run_entry_point
from megatron.errors import UserError
from megatron.ops.io_bench import (
    AioSettings,
    Workload,
    check_folder,
    flush_or_warn,
    handle_factory,
    measure,
    parse_size,
    resolve_device,
)

# About 120 combinations, 2 loops each way: a few minutes on a drive doing 1-2 GB/s.
DEFAULT_SWEEP: dict[str, list[Any]] = {
    "block_size": ["128K", "512K", "1M", "4M", "8M"],
    "queue_depth": [8, 32, 128],
    "intra_op_parallelism": [1, 2],
    "single_submit": [False, True],
    "overlap_events": [False, True],
}


def load_sweep(path: Path | None) -> dict[str, list[Any]]:
    """The default lists, with any list given in the JSON file replacing its default."""
    sweep = dict(DEFAULT_SWEEP)
    if path is not None:
        try:
            given = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"--sweep_config {path} cannot be read as JSON ({exc}): fix or drop it.") from None
        unknown = set(given) - set(sweep) if isinstance(given, dict) else {"(not an object)"}
        if unknown:
            raise UserError(f"--sweep_config {path} has unknown keys {sorted(unknown)}: use only {list(sweep)}.")
        sweep.update(given)
    for key, values in sweep.items():
        if not isinstance(values, list) or not values:
            raise UserError(f"sweep list {key!r} must be a non-empty JSON list, got {values!r}.")
    sweep["block_size"] = [parse_size(v) for v in sweep["block_size"]]
    for key in ("queue_depth", "intra_op_parallelism"):
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sweep[key]):
            raise UserError(f"sweep list {key!r} must hold positive integers, got {sweep[key]!r}.")
    for key in ("single_submit", "overlap_events"):
        if not all(isinstance(v, bool) for v in sweep[key]):
            raise UserError(f"sweep list {key!r} must hold true/false, got {sweep[key]!r}.")
    return sweep


def sweep_settings(sweep: dict[str, list[Any]]) -> list[AioSettings]:
    names = [f.name for f in fields(AioSettings)]
    return [AioSettings(**dict(zip(names, combo))) for combo in itertools.product(*(sweep[n] for n in names))]


def best_settings(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Settings with the highest summed GB/s over the directions measured."""
    totals: dict[str, float] = {}
    for r in results:
        key = json.dumps(r["settings"])
        totals[key] = totals.get(key, 0.0) + r["gbps"]
    return json.loads(max(totals, key=totals.__getitem__))


def build_parser() -> FlagParser:
    parser = FlagParser(prog="ds_nvme_tune", description=__doc__)
    parser.add_argument("--nvme_dir", type=Path, required=True, help="a folder on the drive to tune for")
    parser.add_argument("--sweep_config", type=Path, help="JSON object of lists replacing the default sweep lists")
    parser.add_argument("--no_read", action="store_true", help="skip the read sweep")
    parser.add_argument("--no_write", action="store_true", help="skip the write sweep")
    parser.add_argument("--io_size", default="400M", help="bytes per timed pass, with K/M/G suffixes")
    parser.add_argument("--gpu", action="store_true", help="move data from/to a CUDA tensor")
    parser.add_argument("--gds", action="store_true", help="use GPUDirect Storage (implies --gpu)")
    parser.add_argument("--flush_page_cache", action="store_true", help="drop the page cache before each read")
    parser.add_argument("--log_dir", type=Path, help="write every result to LOG_DIR/nvme_tune.json")
    parser.add_argument("--loops", type=positive_int, default=2, help="timed passes per setting (median kept)")
    parser.add_argument("--verbose", action="store_true", help="print every measurement")
    return parser


def tune(args: argparse.Namespace) -> dict[str, Any]:
    if args.no_read and args.no_write:
        raise UserError("--no_read and --no_write together leave nothing to tune: drop one of them.")
    io_size = parse_size(args.io_size)
    check_folder(args.nvme_dir, io_size, "--nvme_dir")
    settings = sweep_settings(load_sweep(args.sweep_config))
    device = resolve_device(args.gpu, args.gds)
    handle_factory(args.gds)  # a missing op or missing GDS stops here, before any file is written
    flush = flush_or_warn(args.flush_page_cache)
    ops = [op for op, skip in (("write", args.no_write), ("read", args.no_read)) if not skip]
    results: list[dict[str, Any]] = []
    with Workload(args.nvme_dir, io_size, device=device) as workload:
        bar = tqdm(total=len(ops) * len(settings), desc="ds_nvme_tune", unit=" settings")
        for op in ops:
            workload.prepare(op == "read")
            for s in settings:
                results.append(measure(workload, s, op == "read", args.loops, 0, flush_cache=flush, gds=args.gds))
                if args.verbose:
                    tqdm.write(f"{op:5} {results[-1]['gbps']:7.3f} GB/s  {s.describe()}")
                bar.update()
        bar.close()
    best = {op: max((r for r in results if r["op"] == op), key=lambda r: r["gbps"]) for op in ops}
    return {
        "io_size": io_size,
        "device": device.type,
        "gds": args.gds,
        "loops": args.loops,
        "results": results,
        "best": best,
        "aio": best_settings(results),
    }


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """The sweep from ds_nvme_tune's flags: prints the best settings and the "aio" block, returns every result."""
    args = build_parser().parse_args(argv)
    if args.log_dir is not None:  # made first: a bad folder stops the tool before minutes of sweeping, not after
        try:
            args.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(
                f"--log_dir {args.log_dir} cannot be made ({exc.strerror}): pass a folder you can write to."
            ) from None
    summary = tune(args)
    for op, r in summary["best"].items():
        print(f"best {op:5}: {r['gbps']:.3f} GB/s with {AioSettings(**r['settings']).describe()}")
    if args.log_dir is not None:
        path = args.log_dir / "nvme_tune.json"
        path.write_text(json.dumps(summary, indent=2))
        print(f"wrote {len(summary['results'])} results to {path}")
    print("Paste into the config (best read + write together):")
    block = json.dumps(summary["aio"], indent=2)
    print(f'"aio": {block}')
    return summary


def main(argv: list[str] | None = None) -> None:
    """The `ds_nvme_tune` command: returns None, so that the console script exits 0 instead of printing the dict."""
    run_entry_point(lambda: run(argv))


if __name__ == "__main__":
    main()
