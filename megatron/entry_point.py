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


@functools.cache
def _forked_children_take_the_default_action() -> None:
    """A forked worker (a tokenizer pool) dies on SIGTERM, as Pool.terminate() expects: the graceful
    handler's SystemExit can be swallowed there, and Python drops a signal that arrives while the
    child is being set up, so the worker would wait for ever and its parent with it. SIGTERM stays
    blocked across the fork; the child puts the default action back, then the signal mask the
    forking thread had. (A DataLoader starts its workers with the signals this process handles
    blocked, and they keep them blocked: they do not die of them, megatron/data/loader.py.)"""
    masks: dict[int, set[signal.Signals]] = {}  # the forking thread's mask, from before the fork to after

    def block() -> None:
        masks[threading.get_ident()] = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def restore() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, masks.pop(threading.get_ident()))

    def default_then_restore() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        restore()

    os.register_at_fork(before=block, after_in_parent=restore, after_in_child=default_then_restore)


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
