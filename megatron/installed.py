"""A process-wide slot for an observer installed over a scope (the communication log, the timers):
the one kind of global state here (docs/architecture.md), because the ops they watch run in
autograd's threads too, where a context variable does not reach. What is installed changes no
result, and the value before comes back when the scope ends."""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


class Installed(Generic[T]):
    def __init__(self) -> None:
        self.value: T | None = None

    @contextmanager
    def holding(self, value: T | None) -> Iterator[None]:
        """`value` installed inside (None: nothing), the one before it back after."""
        before, self.value = self.value, value
        try:
            yield
        finally:
            self.value = before
