"""ZeRO stage 3's bookkeeping as explicit state machines, free of any process group.

Each bucket of partitioned parameters is FREE (the parameters hold no data), GATHERING (an
all-gather, or a swap read then an all-gather, is on its way into a buffer) or LIVE (the
parameters view the gathered buffer). Only the events in `NEXT` move a bucket; anything else is a
bug in the caller and raises. The ledger counts what the limits are about: the elements gathered
or on their way (`stage3_max_live_parameters`), those on their way (`stage3_prefetch_bucket_size`),
and the gathers in flight, oldest first (a gather that needs a swap buffer finishes the oldest).

The gatherer's own phase is a second machine: forward (a module's forward claims the buckets it
reads and frees them on return) or backward (buckets are freed when their gradients are reduced),
and the order of use is recorded during the first step and replayed for prefetching afterwards.
"""

from collections.abc import Hashable
from enum import Enum


class Residency(Enum):
    FREE = "free"
    GATHERING = "gathering"
    LIVE = "live"


class BucketEvent(Enum):
    GATHER_STARTED = "gather started"
    GATHER_FINISHED = "gather finished"
    RELEASED = "released"


NEXT: dict[tuple[Residency, BucketEvent], Residency] = {
    (Residency.FREE, BucketEvent.GATHER_STARTED): Residency.GATHERING,
    (Residency.GATHERING, BucketEvent.GATHER_FINISHED): Residency.LIVE,
    (Residency.LIVE, BucketEvent.RELEASED): Residency.FREE,
}


class IllegalTransition(RuntimeError):
    pass


class ResidencyLedger:
    """The residency of every bucket and the element counts that follow from it."""

    def __init__(self) -> None:
        self.state: dict[Hashable, Residency] = {}
        self.numel: dict[Hashable, int] = {}
        self.gathering: list[Hashable] = []  # started and not finished, oldest first
        self.live_numel = 0  # gathered or on its way
        self.inflight_numel = 0  # on its way
        self.peak_live_numel = 0

    def add(self, bucket: Hashable, numel: int) -> None:
        self.state[bucket] = Residency.FREE
        self.numel[bucket] = numel

    def record(self, bucket: Hashable, event: BucketEvent) -> None:
        """Move `bucket` by `event` and update the counts."""
        state = self.state[bucket]
        following = NEXT.get((state, event))
        if following is None:
            raise IllegalTransition(f"a ZeRO-3 bucket that is {state.value} cannot be {event.value}")
        numel = self.numel[bucket]
        if event is BucketEvent.GATHER_STARTED:
            self.gathering.append(bucket)
            self.live_numel += numel
            self.inflight_numel += numel
            self.peak_live_numel = max(self.peak_live_numel, self.live_numel)
        elif event is BucketEvent.GATHER_FINISHED:
            self.gathering.remove(bucket)
            self.inflight_numel -= numel
        else:
            self.live_numel -= numel
        self.state[bucket] = following


class Phase(Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


class StepEvent(Enum):
    BACKWARD_STARTED = "backward started"
    BACKWARD_FINISHED = "backward finished"


class GathererPhase:
    """Forward or backward, and whether the order of use is still being recorded (until the
    first backward finishes) or is replayed for prefetching."""

    def __init__(self) -> None:
        self.phase = Phase.FORWARD
        self.recording = True

    @property
    def in_backward(self) -> bool:
        return self.phase is Phase.BACKWARD

    def record(self, event: StepEvent) -> bool:
        """Move by `event`; True when this event ended the recording of the trace."""
        expected = Phase.FORWARD if event is StepEvent.BACKWARD_STARTED else Phase.BACKWARD
        if self.phase is not expected:
            raise IllegalTransition(
                f"the ZeRO-3 gatherer is in {self.phase.value}, so a {event.value} event is out of order"
            )
        if event is StepEvent.BACKWARD_STARTED:
            self.phase = Phase.BACKWARD
            return False
        self.phase = Phase.FORWARD
        ended, self.recording = self.recording, False
        return ended
