"""The disk operations of a checkpoint save, for the tests that kill a run at each of them."""

import os
import signal

import megatron.checkpoint.iterations as iterations_module
import megatron.checkpoint.save as save_module

# every disk operation of a save, in the order the protocol makes them
PROTOCOL_STEPS = [
    (save_module, "save_tensors"),
    (save_module, "fsync_path"),
    (save_module, "write_manifest"),
    (save_module, "replace_durably"),
    (save_module.os, "replace"),
    (save_module.shutil, "rmtree"),
    (iterations_module, "write_text_durably"),
]


def count_protocol_steps(kill_at: int | None, calls: list[int]) -> None:
    """Wrap every protocol step: count calls, and SIGKILL this process at call `kill_at`."""
    for module, name in PROTOCOL_STEPS:
        real = getattr(module, name)

        def counted(*args, _real=real, **kwargs):
            calls.append(1)
            if len(calls) == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return _real(*args, **kwargs)

        setattr(module, name, counted)
