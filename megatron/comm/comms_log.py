"""DeepSpeed's communication logger: every collective and point-to-point op the toolkit issues
(through megatron/comm/collectives.py) timed and grouped by op and message size, with the
algorithmic and bus bandwidths of NCCL-tests (its PERFORMANCE.md): algbw = bytes / time, and
busbw = algbw x 2(n-1)/n for an all-reduce, x (n-1)/n for all-gather, reduce-scatter and
all-to-all, x 1 for broadcast and send/recv. Message sizes are NCCL-tests' too: the whole gathered
or scattered buffer, an all-to-all's send buffer.

As DeepSpeed's does, a logged op is synchronised (an asynchronous one is waited for at once), so
its latency is its own, at the price of the overlap it had. A log records only while it is
installed (`recording()`, megatron/installed.py)."""

import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.installed import Installed

# the ops a log knows, by the names DeepSpeed's `prof_ops` takes
OPS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
    "send",
    "recv",
    "sendrecv",
)


def check_op_names(names: tuple[str, ...] | list[str]) -> None:
    unknown = sorted(set(names) - set(OPS))
    if unknown:
        raise ValueError(f"prof_ops names {unknown}, which are not ops; name some of {list(OPS)}")


def bus_factor(op: str, ranks: int) -> float:
    """busbw / algbw for `op` over `ranks` ranks (NCCL-tests)."""
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if op in ("all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single"):
        return (ranks - 1) / ranks
    return 1.0


@dataclass(frozen=True)
class OpSummary:
    """The calls of one op with one message size (over one group size)."""

    op: str
    message_bytes: int
    ranks: int
    count: int
    total_s: float

    @property
    def mean_s(self) -> float:
        return self.total_s / self.count

    @property
    def algbw_gbps(self) -> float:
        """Algorithmic bandwidth, GB/s (1e9 bytes), over the calls' total time."""
        return self.message_bytes * self.count / self.total_s / 1e9 if self.total_s > 0 else 0.0

    @property
    def busbw_gbps(self) -> float:
        return self.algbw_gbps * bus_factor(self.op.split(" | ")[0], self.ranks)


@dataclass(frozen=True)
class OpTotal:
    """Every call of one op: what TensorBoard gets."""

    op: str
    count: int
    bytes: int
    total_s: float


def size_to_string(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


class CommsLog:
    """The ds_config `comms_logger` block's log: `prof_all` every op, else those in `prof_ops`;
    `verbose` prints each op as it completes (on the first rank); `debug` files each op under its
    caller's name as well ("all_reduce | reduce_gradients")."""

    def __init__(
        self,
        prof_all: bool = True,
        prof_ops: tuple[str, ...] = (),
        verbose: bool = False,
        debug: bool = False,
        prints: bool = True,
        device: torch.device | None = None,
    ) -> None:
        check_op_names(prof_ops)
        self.ops = frozenset(OPS if prof_all else prof_ops)
        self.verbose, self.debug, self.prints = verbose, debug, prints
        self.sync = device is not None and device.type == "cuda"
        # (op, message bytes, ranks) -> [count, total seconds]
        self.calls: dict[tuple[str, int, int], list[float]] = defaultdict(lambda: [0, 0.0])

    def logs(self, op: str) -> bool:
        return op in self.ops

    def timed(
        self, op: str, message_bytes: int, group: dist.ProcessGroup | None, issue: Callable[[], object]
    ) -> object:
        """Issue the op, wait for it, and file its latency."""
        if self.sync:
            torch.cuda.synchronize()
        began = time.perf_counter()
        work = issue()
        works = work if isinstance(work, list) else [work]
        for each in works:
            if each is not None:
                each.wait()
        if self.sync:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        # 0 this, 1 collectives' _issue, 2 the op's wrapper, 3 who called it
        name = f"{op} | {sys._getframe(3).f_code.co_name}" if self.debug else op
        record = self.calls[(name, message_bytes, dist.get_world_size(group))]
        record[0] += 1
        record[1] += seconds
        if self.verbose and self.prints:
            print(
                f"comm op: {name} | time (ms): {1000 * seconds:.3f} | msg size: {size_to_string(message_bytes)}",
                flush=True,
            )
        return work

    def reset(self) -> None:
        """Forget what was logged (after a warm-up, say)."""
        self.calls.clear()

    def summary(self) -> list[OpSummary]:
        """Every (op, message size) seen, by op then size."""
        return [
            OpSummary(op, size, ranks, int(count), total)
            for (op, size, ranks), (count, total) in sorted(self.calls.items())
        ]

    def totals(self) -> list[OpTotal]:
        by_op: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
        for row in self.summary():
            total = by_op[row.op.split(" | ")[0]]
            total[0] += row.count
            total[1] += row.count * row.message_bytes
            total[2] += row.total_s
        return [OpTotal(op, int(count), int(size), seconds) for op, (count, size, seconds) in by_op.items()]

    def summary_text(self) -> str:
        """DeepSpeed's `log_summary()` table: op, message size, count, latencies, bandwidths."""
        header = (
            f"{'Comm. Op':<40}{'Message Size':>14}{'Count':>8}{'Total Latency(ms)':>19}"
            f"{'Avg Latency(ms)':>17}{'algbw(GB/s)':>13}{'busbw(GB/s)':>13}"
        )
        lines, last_op = [header], None
        for row in self.summary():
            op = row.op if row.op != last_op else ""
            last_op = row.op
            lines.append(
                f"{op:<40}{size_to_string(row.message_bytes):>14}{row.count:>8}{1000 * row.total_s:>19.2f}"
                f"{1000 * row.mean_s:>17.3f}{row.algbw_gbps:>13.3f}{row.busbw_gbps:>13.3f}"
            )
        return "\n".join(lines)

    def log_summary(self) -> None:
        if self.prints:
            print(self.summary_text(), flush=True)

    @contextmanager
    def recording(self) -> Iterator["CommsLog"]:
        """Install this log for the ops issued inside (the log installed before comes back after)."""
        LAST.value = self
        with INSTALLED.holding(self):
            yield self


INSTALLED: Installed[CommsLog] = Installed()  # the log recording now
LAST: Installed[CommsLog] = Installed()  # the one that recorded last, for a summary after the run


def log_summary() -> None:
    """DeepSpeed's `deepspeed.comm.log_summary()`: print the table of the log recording now, or
    of the one that recorded last."""
    log = INSTALLED.value or LAST.value
    if log is None:
        raise RuntimeError("no communication log is recording; turn on the ds_config comms_logger block")
    log.log_summary()
