"""How every command-line entry point ends: a `UserError` prints its one sentence (on rank 0 only)
and exits with status 1, without a traceback; the process group is closed either way."""

import os
import sys
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from megatron.errors import UserError

T = TypeVar("T")


def run_entry_point(body: Callable[[], T]) -> T:
    try:
        return body()
    except UserError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
