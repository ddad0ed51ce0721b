"""How every command-line entry point ends: a `UserError` prints its one sentence (on rank 0 only)
and exits with status 1, without a traceback; the process group is closed either way. SIGTERM
ends the process through Python's normal exit (status 143) rather than the default abrupt one, so
cleanup still runs: NVMe swap folders are removed, a partial checkpoint is left as `.tmp` only.
"""

import functools
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


def _block_sigterm() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def _unblock_sigterm() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _default_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _unblock_sigterm()


@functools.cache
def _forked_children_take_the_default_action() -> None:
    """A forked worker (a tokenizer pool, a DataLoader) dies on SIGTERM, as Pool.terminate() expects:
    the graceful handler's SystemExit can be swallowed there, and Python drops a signal that arrives
    while the child is being set up, so the worker would wait for ever and its parent with it.
    SIGTERM stays blocked across the fork and the child unblocks it once the default is back."""
    os.register_at_fork(before=_block_sigterm, after_in_parent=_unblock_sigterm, after_in_child=_default_sigterm)


def run_entry_point(body: Callable[[], T]) -> T:
    if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
        _forked_children_take_the_default_action()
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
