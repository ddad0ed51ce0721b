"""How every command-line entry point ends: a `UserError` prints its one sentence (on rank 0 only)
and exits with status 1, without a traceback; the process group is closed either way. SIGTERM
ends the process through Python's normal exit (status 143) rather than the default abrupt one, so
cleanup still runs: NVMe swap folders are removed, a partial checkpoint is left as `.tmp` only.
"""

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import TypeVar

import torch.distributed as dist

from megatron.errors import UserError

T = TypeVar("T")


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def run_entry_point(body: Callable[[], T]) -> T:
    if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
        signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        return body()
    except UserError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    except BrokenPipeError:  # the reader went away (`tool | head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
