"""ZeRO stage 3's state machines (megatron/runtime/zero/residency.py), without a process group:
the transition table itself, the counts it keeps, and the gatherer driving it through a real
forward and backward of a one-rank partition."""

import itertools

import pytest
import torch
from torch import nn

from megatron.runtime.config.schema import ZeroConfig
from megatron.runtime.zero.gatherer import ParameterGatherer
from megatron.runtime.zero.param_partition import ParamPartition
from megatron.runtime.zero.residency import (
    NEXT,
    BucketEvent,
    GathererPhase,
    IllegalTransition,
    Phase,
    Residency,
    ResidencyLedger,
    StepEvent,
)
from megatron.runtime.zero.stages import buckets_by_module


def test_a_bucket_cycles_free_gathering_live_free_and_the_counts_follow() -> None:
    ledger = ResidencyLedger()
    ledger.add("a", 10)
    ledger.add("b", 5)
    ledger.record("a", BucketEvent.GATHER_STARTED)
    ledger.record("b", BucketEvent.GATHER_STARTED)
    assert (ledger.live_numel, ledger.inflight_numel, ledger.gathering) == (15, 15, ["a", "b"])
    ledger.record("a", BucketEvent.GATHER_FINISHED)
    assert (ledger.state["a"], ledger.live_numel, ledger.inflight_numel, ledger.gathering) == (
        Residency.LIVE,
        15,
        5,
        ["b"],
    )
    ledger.record("a", BucketEvent.RELEASED)
    ledger.record("b", BucketEvent.GATHER_FINISHED)
    assert (ledger.state["a"], ledger.state["b"], ledger.live_numel, ledger.inflight_numel) == (
        Residency.FREE,
        Residency.LIVE,
        5,
        0,
    )
    ledger.record("b", BucketEvent.RELEASED)
    assert (ledger.live_numel, ledger.peak_live_numel) == (0, 15)


@pytest.mark.parametrize(
    "state, event", [(s, e) for s, e in itertools.product(Residency, BucketEvent) if (s, e) not in NEXT]
)
def test_every_transition_outside_the_table_raises_and_changes_nothing(state: Residency, event: BucketEvent) -> None:
    ledger = ResidencyLedger()
    ledger.add("a", 3)
    path = {
        Residency.FREE: [],
        Residency.GATHERING: [BucketEvent.GATHER_STARTED],
        Residency.LIVE: [BucketEvent.GATHER_STARTED, BucketEvent.GATHER_FINISHED],
    }[state]
    for step in path:
        ledger.record("a", step)
    before = (ledger.state["a"], ledger.live_numel, ledger.inflight_numel, list(ledger.gathering))
    with pytest.raises(IllegalTransition, match=f"is {state.value} cannot be {event.value}"):
        ledger.record("a", event)
    assert (ledger.state["a"], ledger.live_numel, ledger.inflight_numel, list(ledger.gathering)) == before


def test_the_phase_alternates_and_only_the_first_backward_ends_the_recording() -> None:
    phase = GathererPhase()
    assert (phase.phase, phase.recording) == (Phase.FORWARD, True)
    with pytest.raises(IllegalTransition, match="in forward"):
        phase.record(StepEvent.BACKWARD_FINISHED)
    assert phase.record(StepEvent.BACKWARD_STARTED) is False and phase.in_backward
    with pytest.raises(IllegalTransition, match="in backward"):
        phase.record(StepEvent.BACKWARD_STARTED)
    assert phase.record(StepEvent.BACKWARD_FINISHED) is True and not phase.recording
    phase.record(StepEvent.BACKWARD_STARTED)
    assert phase.record(StepEvent.BACKWARD_FINISHED) is False


def _partitioned_mlp() -> tuple[nn.Sequential, nn.Sequential, ParameterGatherer]:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    model.load_state_dict(reference.state_dict())
    params = list(model.parameters())
    owner = {p: child for child in model for p in child.parameters(recurse=False)}
    part = ParamPartition(params, [n for n, _ in model.named_parameters()], None, buckets_by_module(params, owner))
    config = ZeroConfig(stage=3, stage3_param_persistence_threshold=0)
    return reference, model, ParameterGatherer(model, [part], config)


def test_the_gatherer_frees_each_module_after_its_forward_and_replays_the_trace_as_prefetches() -> None:
    reference, model, gatherer = _partitioned_mlp()
    first, last = gatherer.units
    assert all(gatherer.state(u) is Residency.FREE for u in gatherer.units)
    seen: list[tuple[Residency, Residency]] = []
    model[2].register_forward_hook(lambda *_: seen.append((gatherer.state(first), gatherer.state(last))), prepend=True)
    model[0].register_forward_hook(lambda *_: seen.append((gatherer.state(first), gatherer.state(last))), prepend=True)
    x = torch.randn(5, 4)

    out = model(x)
    torch.testing.assert_close(out, reference(x), rtol=0, atol=0)
    assert all(p.numel() == 0 for p in model.parameters())  # freed parameters hold no data
    # while the second linear runs, the first's bucket is already free again; nothing is prefetched yet
    assert seen == [(Residency.LIVE, Residency.FREE), (Residency.FREE, Residency.LIVE)]
    gatherer.before_backward()
    out.sum().backward()
    gatherer.after_backward()
    assert all(gatherer.state(u) is Residency.FREE for u in gatherer.units) and gatherer.ledger.live_numel == 0
    assert not gatherer.phase.recording and list(dict.fromkeys(gatherer.trace)) == [first, last]

    seen.clear()
    model(x)
    # the recorded order starts the last linear's gather while the first one runs
    assert seen[0] == (Residency.LIVE, Residency.GATHERING)
    assert gatherer.peak_live_numel == first.numel + last.numel
