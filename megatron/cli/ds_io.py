"""`ds_io`: one read or write measurement of the async-I/O op, printed as GB/s (1 GB = 1e9 bytes)."""

import argparse
from pathlib import Path
from typing import Any

from megatron.config.parser import FlagParser, non_negative_int, positive_int
from megatron.entry_point import run_entry_point
from megatron.ops.io_bench import (
    AioSettings,
    Workload,
    check_folder,
    flush_or_warn,
    format_size,
    measure,
    parse_size,
    resolve_device,
)


def build_parser() -> FlagParser:
    parser = FlagParser(prog="ds_io", description=__doc__)
    op = parser.add_mutually_exclusive_group(required=True)
    op.add_argument("--read", action="store_true", help="time reads of a file written once beforehand")
    op.add_argument("--write", action="store_true", help="time writes into a newly created file")
    parser.add_argument("--folder", type=Path, required=True, help="where the test file goes (removed after)")
    parser.add_argument("--io_size", default="400M", help="bytes per pass, with K/M/G suffixes")
    parser.add_argument("--block_size", default="1M")
    parser.add_argument("--queue_depth", type=positive_int, default=32)
    parser.add_argument("--intra_op_parallelism", type=positive_int, default=1)
    parser.add_argument("--single_submit", action="store_true")
    parser.add_argument("--overlap_events", action="store_true")
    parser.add_argument(
        "--requests", type=positive_int, default=1, help="split the pass into this many files and async ops"
    )
    parser.add_argument(
        "--sequential_requests",
        action="store_true",
        help="wait after each async op instead of once after all (matters with --requests > 1)",
    )
    parser.add_argument("--loops", type=positive_int, default=3)
    parser.add_argument("--warmup", type=non_negative_int, default=1)
    parser.add_argument(
        "--locked",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="use page-locked buffers from new_cpu_locked_tensor",
    )
    parser.add_argument("--gpu", action="store_true", help="move data from/to a CUDA tensor")
    parser.add_argument("--flush_page_cache", action="store_true", help="drop the page cache before each read")
    return parser


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """One measurement from ds_io's flags: prints its one-line summary and returns the numbers."""
    args = build_parser().parse_args(argv)
    settings = AioSettings(
        parse_size(args.block_size),
        args.queue_depth,
        args.intra_op_parallelism,
        args.single_submit,
        args.overlap_events,
    )
    io_size = parse_size(args.io_size)
    check_folder(args.folder, io_size)
    device = resolve_device(args.gpu)
    flush = flush_or_warn(args.flush_page_cache)
    with Workload(args.folder, io_size, args.requests, args.locked, device) as workload:
        workload.prepare(args.read)
        result = measure(workload, settings, args.read, args.loops, args.warmup, args.sequential_requests, flush)
    loops = " ".join(f"{g:.3f}" for g in result["loops_gbps"])
    print(
        f"{result['op']} io_size={format_size(result['io_size'])} {settings.describe()}: "
        f"{result['gbps']:.3f} GB/s (median; loops {loops})"
    )
    return result


def main(argv: list[str] | None = None) -> None:
    """The `ds_io` command: returns None, so that the console script exits 0 instead of printing the dict."""
    run_entry_point(lambda: run(argv))


if __name__ == "__main__":
    main()
