"""The ds_config `comms_logger` block: every collective the toolkit issues is logged with its
message size and timed, the bandwidths are NCCL-tests', and a 2-rank EP=2 ZeRO-2 training run's
log holds exactly the collectives torch.distributed received (counted by wrapping torch's own
functions, so a call that bypassed the log would show)."""

import json
import sys
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron import comm
from megatron.comm.comms_log import OPS, CommsLog, OpSummary, bus_factor
from megatron.config.flags import parse_args, with_data_parallel_size
from megatron.parallel import build_parallel_grid
from megatron.training.log import TrainingLogger
from megatron.training.loop import Trainer
from tests.dist_utils import run_distributed
from tests.training_fixtures import moe_layout_flags, write_corpus


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# what NCCL-tests calls each op's size, from torch's arguments: the whole buffer gathered or
# scattered, an all-to-all's send buffer, a point-to-point batch's sends (its receives if none)
SIZES = {
    "all_reduce": lambda args: _nbytes(args[0]),
    "all_gather": lambda args: sum(map(_nbytes, args[0])),
    "all_gather_single": lambda args: _nbytes(args[0]),
    "reduce_scatter": lambda args: sum(map(_nbytes, args[1])),
    "reduce_scatter_single": lambda args: _nbytes(args[1]),
    "all_to_all_single": lambda args: _nbytes(args[1]),
    "broadcast": lambda args: _nbytes(args[0]),
    "batch_isend_irecv": lambda args: sum(
        _nbytes(op.tensor) for op in args[0] if op.op is dist.isend or all(o.op is dist.irecv for o in args[0])
    ),
}
LOGGED_AS = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


def _p2p_name(ops: list[dist.P2POp]) -> str:
    sends = sum(op.op is dist.isend for op in ops)
    return "recv" if not sends else "send" if sends == len(ops) else "sendrecv"


def _count_torch_calls(counted: Counter) -> None:
    """Wrap torch.distributed's functions to count the calls made from the toolkit's code."""
    for name, size in SIZES.items():
        original = getattr(dist, name)

        def counting(*args, _original=original, _name=name, _size=size, **kwargs):
            if sys._getframe(1).f_globals["__name__"].startswith("megatron"):
                op = _p2p_name(args[0]) if _name == "batch_isend_irecv" else LOGGED_AS.get(_name, _name)
                counted[(op, _size(args))] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counting)


def _logged_and_counted(corpus: str, ds_config: str, tensorboard: str) -> dict[str, torch.Tensor]:
    grid = build_parallel_grid(torch.device("cpu"), ep_size=2)
    tensorboard_dir = tensorboard if grid.rank == 0 else None
    flags = moe_layout_flags(corpus, ep=2, train_iters=3, log_interval=3, tensorboard_dir=tensorboard_dir)
    config = with_data_parallel_size(parse_args(flags + ["--deepspeed", "--deepspeed_config", ds_config]), 2)
    trainer = Trainer(config, grid)
    trainer.engine.comms_log.reset()  # the engine's first broadcast: before the counting began
    counted: Counter = Counter()
    _count_torch_calls(counted)
    trainer.train()
    logged = {(OPS.index(row.op), row.message_bytes): row.count for row in trainer.engine.comms_log.summary()}
    rows = lambda found: torch.tensor([[*key, n] for key, n in sorted(found.items())], dtype=torch.int64)  # noqa: E731
    return {"logged": rows(logged), "counted": rows({(OPS.index(op), size): n for (op, size), n in counted.items()})}


def test_a_two_rank_ep2_zero2_run_logs_every_collective_torch_received(tmp_path, capfd):
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(
        json.dumps({"zero_optimization": {"stage": 2}, "comms_logger": {"enabled": True, "prof_all": True}})
    )
    corpus = write_corpus(tmp_path)
    results = run_distributed(_logged_and_counted, 2, corpus, str(ds_config), str(tmp_path / "tb"))
    for rank in results:
        torch.testing.assert_close(rank["logged"], rank["counted"], rtol=0, atol=0)
        ops = {OPS[i] for i in rank["logged"][:, 0].tolist()}
        # the experts' exchange, ZeRO 2's reduce-scatter and gather, the loop's and the engine's reductions
        assert {"all_to_all_single", "reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce"} <= ops
    printed = capfd.readouterr().out
    assert printed.count("Comm. Op") == 1 and "all_to_all_single" in printed  # the summary, by the first rank
    scalars = EventAccumulator(str(tmp_path / "tb")).Reload().Tags()["scalars"]
    assert "comms/all_to_all_single/count" in scalars and "comms/all_reduce/latency-ms" in scalars


def test_bus_bandwidth_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_reduce", 2) == 1.0
    for op in ("all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        assert bus_factor(op, 4) == 0.75
    assert bus_factor("broadcast", 8) == 1.0 and bus_factor("sendrecv", 2) == 1.0
    row = OpSummary("all_reduce | step", message_bytes=10**9, ranks=4, count=2, total_s=4.0)
    assert row.algbw_gbps == 0.5 and row.busbw_gbps == 0.75 and row.mean_s == 2.0


def test_prof_ops_debug_and_verbose_on_one_rank(tmp_path, capsys):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        x = torch.ones(256)
        log = CommsLog(prof_all=False, prof_ops=("all_reduce",), verbose=True, debug=True)
        comm.all_reduce(x)  # nothing records yet
        with log.recording():
            comm.all_reduce(x)
            comm.broadcast(x, src=0)  # not in prof_ops
            work = comm.all_reduce(x, async_op=True)
            assert work.is_completed()  # a logged op is waited for at once
        comm.all_reduce(x)
        [row] = log.summary()
        fn = "test_prof_ops_debug_and_verbose_on_one_rank"
        assert (row.op, row.message_bytes, row.count, row.ranks) == (f"all_reduce | {fn}", 1024, 2, 1)
        assert capsys.readouterr().out.count(f"comm op: all_reduce | {fn} | time (ms): ") == 2
        comm.log_summary()  # the last log that recorded
        table = capsys.readouterr().out
        assert "Avg Latency(ms)" in table and "1.00 KB" in table
    finally:
        dist.destroy_process_group()


def test_recording_restores_the_log_before_it():
    outer, inner = CommsLog(), CommsLog()
    with outer.recording():
        with inner.recording():
            assert comm.comms_log.INSTALLED.value is inner
        assert comm.comms_log.INSTALLED.value is outer
    assert comm.comms_log.INSTALLED.value is None


def test_comms_totals_go_to_tensorboard(tmp_path):
    log = CommsLog()
    log.calls[("all_reduce", 4096, 2)] = [3, 0.006]
    log.calls[("all_reduce", 1024, 2)] = [1, 0.002]
    writer = TrainingLogger(str(tmp_path), enabled=True)
    writer.comms_totals(5, log.totals())
    writer.close()
    events = EventAccumulator(str(tmp_path)).Reload()
    assert [e.value for e in events.Scalars("comms/all_reduce/count")] == [4]
    assert events.Scalars("comms/all_reduce/megabytes")[0].value == pytest.approx(13312 / 1e6)
    assert events.Scalars("comms/all_reduce/latency-ms")[0].value == pytest.approx(8.0)


def test_unknown_prof_ops_are_refused_by_name():
    with pytest.raises(ValueError, match=r"prof_ops names \['allreduce'\]"):
        CommsLog(prof_all=False, prof_ops=("allreduce",))
