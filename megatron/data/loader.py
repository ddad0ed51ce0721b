"""Pretraining data loader with Megatron's sequential sampler: resumable at any consumed sample.

Its worker processes are the main process's helpers, so two things the main process owns stay
with it:
- Signals. A scheduler preempts by sending SIGTERM to the whole process group (Slurm, Kubernetes),
  and torchrun forwards one to each rank's group, so the workers receive it too. A worker must not
  die of a signal the main process handles (`--exit-signal-handler`'s, or the entry point's SIGTERM):
  its death would end the run with torch's "DataLoader worker ... killed by signal" before the
  handler could save. So the workers drop those signals, except SIGTERM from the main process itself
  (DataLoader's terminate() of a worker that is stuck at exit), which ends the worker as torch's own
  handler does. They still end with the main process: DataLoader stops them when its iterator goes,
  and they notice within seconds when the main process has died. (Blocked from before the fork, not
  set to SIG_IGN in the worker: a signal that came while a worker starts would kill it, and an
  ignored SIGTERM could not stop a stuck one; a thread takes them with sigwaitinfo, which knows the
  sender.)
- Errors. torch re-raises a worker's exception in the main process as the same class built around
  "Caught DataError in DataLoader worker process 0.\nOriginal Traceback ..."; for a `UserError` the
  iterator re-raises it with the worker's own sentence, which the entry point prints.
"""

import contextlib
import functools
import os
import signal
import threading
from collections.abc import Iterator

import numpy as np
import torch

from megatron.errors import ConfigError, DataError, UserError

# the signals a scheduler, a launcher or the user may send that a process can catch
_CATCHABLE = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


class PretrainingSampler(torch.utils.data.Sampler):
    """Yields this rank's micro-batch of sample indices, walking the dataset in order.

    Each global micro-step takes the next micro_batch_size * dp_size indices and rank r keeps
    [r * mbs, (r + 1) * mbs), so the stream depends only on consumed_samples: a resumed run
    sees exactly the batches an uninterrupted one would. An incomplete last step is dropped.
    """

    def __init__(
        self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int
    ) -> None:
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ConfigError(
                "data loader needs micro_batch_size >= 1 and 0 <= dp_rank < dp_size, "
                f"got {micro_batch_size}, {dp_rank} and {dp_size}."
            )
        if not 0 <= consumed_samples < total_samples:
            raise DataError(
                f"cannot resume at consumed sample {consumed_samples}: the dataset has {total_samples} samples; "
                "raise the number of training samples or start from an earlier checkpoint."
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.global_step_size = micro_batch_size * dp_size
        self.rank_start = dp_rank * micro_batch_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.global_step_size

    def __iter__(self) -> Iterator[list[int]]:
        for step_start in range(
            self.consumed_samples, self.total_samples - self.global_step_size + 1, self.global_step_size
        ):
            first = step_start + self.rank_start
            yield list(range(first, first + self.micro_batch_size))


def collate_text(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    return {"text": torch.from_numpy(np.stack([s["text"] for s in samples]).astype(np.int64))}


def handled_signals() -> frozenset[signal.Signals]:
    """The signals this process acts on itself: those with a Python handler of its own (Python's
    default SIGINT handler, which raises KeyboardInterrupt everywhere, does not count)."""
    return frozenset(
        s for s in _CATCHABLE if callable(handler := signal.getsignal(s)) and handler is not signal.default_int_handler
    )


def _drop_in_worker(signals: frozenset[signal.Signals], main_pid: int, worker_id: int) -> None:
    """worker_init_fn: keep `signals` blocked (the main process blocked them before it started the
    worker, so none can kill a worker that is still starting) and take them on a thread as they come."""
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    threading.Thread(target=_take_signals, args=(signals, main_pid), name="pt_data_worker_signals", daemon=True).start()


def _take_signals(signals: frozenset[signal.Signals], main_pid: int) -> None:
    while True:
        received = signal.sigwaitinfo(signals)
        if received.si_signo == signal.SIGTERM and received.si_pid == main_pid:
            os._exit(0)  # what torch's worker SIGTERM handler does for its parent's terminate()


@contextlib.contextmanager
def _blocked(signals: frozenset[signal.Signals]) -> Iterator[None]:
    """This thread holds `signals` back while it forks workers: they arrive once it is done."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def worker_sentence(error: BaseException) -> str | None:
    """The message of the exception a DataLoader worker raised, recovered from the text torch
    re-raises it with (the traceback's last line is "module.Class: message"); None for an exception
    that was not re-raised from a worker."""
    kind = type(error)
    text = str(error)
    if not text.startswith(f"Caught {kind.__name__} in DataLoader worker process "):
        return None
    name = (
        kind.__qualname__ if kind.__module__ in ("__main__", "builtins") else f"{kind.__module__}.{kind.__qualname__}"
    )
    _, found, sentence = text.rpartition(f"\n{name}: ")
    return sentence.rstrip("\n") if found else None


class _WorkerSentences:
    """The DataLoader's iterator, with a `UserError` from a worker re-raised as its own sentence."""

    def __init__(self, batches: Iterator[dict[str, torch.Tensor]]) -> None:
        self.batches = batches

    def __iter__(self) -> "_WorkerSentences":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        try:
            return next(self.batches)
        except UserError as error:
            sentence = worker_sentence(error)
            if sentence is None:
                raise
            raise type(error)(sentence) from error


class PretrainingLoader(torch.utils.data.DataLoader):
    """A DataLoader whose workers do not die of `shielded` signals and whose iterator re-raises a
    worker's `UserError` as its own sentence (see the module docstring)."""

    def __init__(self, *args, shielded: frozenset[signal.Signals] = frozenset(), **kwargs) -> None:
        self.shielded = shielded
        if shielded and kwargs.get("num_workers", 0) > 0:
            kwargs["worker_init_fn"] = functools.partial(_drop_in_worker, shielded, os.getpid())
        super().__init__(*args, **kwargs)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        with _blocked(self.shielded if self.num_workers > 0 else frozenset()):
            batches = super().__iter__()  # starts the workers (once, as they are persistent)
        return _WorkerSentences(batches)


def build_pretraining_loader(
    dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int, num_workers: int = 0
) -> PretrainingLoader:
    """DataLoader giving {"text": LongTensor [micro_batch_size, seq_length + 1]} for this DP rank."""
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    return sampled_loader(dataset, sampler, num_workers)


def sampled_loader(dataset, batch_sampler: torch.utils.data.Sampler, num_workers: int = 0) -> PretrainingLoader:
    """DataLoader giving {"text": LongTensor [len(indices), seq_length + 1]} for each list of sample
    indices `batch_sampler` yields. Its workers drop the signals this process handles when the loader
    is built (`handled_signals`)."""
    return PretrainingLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=num_workers,
        collate_fn=collate_text,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        # its own generator: making an iterator must not draw from the global RNG, or a resumed
        # run's dropout would differ from an uninterrupted one
        generator=torch.Generator(),
        shielded=handled_signals(),
    )
