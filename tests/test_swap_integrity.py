"""Swap files that can be left alone for weeks: a swap disk that hands back other bytes than were
written (zeros, random bytes, one flipped bit, blocks moved, a lost write) stops training with a
SwapError that names the file; the folders of runs whose processes died are removed at the next
start, and never those of a live run, another host's or another container's; a run's folder goes
when its interpreter exits through SystemExit or KeyboardInterrupt."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron.checkpoint.checksum import BLOCK_BYTES as BLOCK
from megatron.runtime.engine import Engine
from megatron.runtime.swap.folder import OWNER_FILE, Owner, SwapFolder, read_owner, start_time, this_process
from megatron.runtime.swap.slots import SwapError
from tests.dist_utils import run_distributed
from tests.test_offload import BATCH, H, single_engine, swapping_engine, train

REPO = Path(__file__).resolve().parents[1]


def next_step(engine: Engine) -> None:
    engine.backward(engine(torch.randn(BATCH, 3, H)).square().mean())
    engine.step()


def data_blocks(data: bytes) -> list[int]:
    """Offsets of the 4 KiB blocks of `data` that hold something other than zeros."""
    return [at for at in range(0, len(data), BLOCK) if any(data[at : at + BLOCK])]


def damage(path: Path, how: str, older: bytes) -> None:
    """Change the file as a failing disk would; `older` is the file as it was one step earlier."""
    data = bytearray(path.read_bytes())
    first, second = data_blocks(bytes(data))[:2]
    block = slice(first, first + BLOCK)
    if how == "zeros":
        data[block] = bytes(len(data[block]))
    elif how == "random":
        data[block] = np.random.default_rng(0).bytes(len(data[block]))
    elif how == "bit":
        data[first + 17] ^= 1 << 3
    elif how == "moved":  # two blocks trade places
        data[block], data[second : second + BLOCK] = data[second : second + BLOCK], data[block]
    elif how == "stale":  # the last write was lost
        data[:] = older
    assert bytes(data) != path.read_bytes()
    path.write_bytes(data)


# the swap file, and the state the read that finds the damage brings (the optimizer's, or a gather's)
SWAPPED = {"moments": ("p0_s0.swp", "optimizer state"), "master": ("params0.swp", "parameter partitions")}


@pytest.mark.parametrize("how", ["zeros", "random", "bit", "moved", "stale"])
@pytest.mark.parametrize("kind", SWAPPED)
def test_damaged_swap_file_stops_training_naming_the_file(tmp_path, kind, how):
    engine = swapping_engine(tmp_path)
    name, what = SWAPPED[kind]
    path = (engine.optimizer.folder if kind == "moments" else engine.strategy.swapper.folder).path / name
    train(engine, 0, 1)
    older = path.read_bytes()
    train(engine, 1, 2)
    damage(path, how, older)
    with pytest.raises(
        SwapError,
        match=rf"the swap disk returned damaged data for {what} in {re.escape(str(path))}, "
        r"bytes [\d,]+-[\d,]+ .*training stopped and the last checkpoint is intact",
    ):
        next_step(engine)


def test_zeros_written_at_start_up_are_checked_too(tmp_path):
    engine = single_engine(tmp_path)  # no fast_init: every moment file starts as zeros on disk
    path = engine.optimizer.folder.path / "p0_s0.swp"
    path.write_bytes(np.random.default_rng(0).bytes(path.stat().st_size))
    engine.backward(engine(torch.randn(2, 3, H)).square().mean())
    with pytest.raises(SwapError, match=re.escape(str(path))):
        engine.step()


def gone_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def write_run(root: Path, name: str, owners: list[Owner | None], age_s: float = 0) -> Path:
    """A run folder with one rank folder per owner (None: no record) holding a swap file."""
    run = root / name
    run.mkdir()
    for rank, owner in enumerate(owners):
        (run / f"rank{rank}").mkdir()
        (run / f"rank{rank}" / "p0_s0.swp").write_bytes(b"moments")
        if owner is not None:
            (run / f"rank{rank}" / OWNER_FILE).write_text(json.dumps(asdict(owner)))
    then = time.time() - age_s
    for path in [*run.rglob("*"), run]:
        os.utime(path, (then, then))
    return run


DAY = 24 * 3600
# the owner records of a run folder's rank folders (None: no record) made from this process and a
# pid that is gone, how long ago the folder last changed, and why it is removed (None: it is kept)
STALE_CASES = {
    "dead pid": (lambda me, gone: [gone], 0, "of a run whose process {dead} is gone"),
    "dead ranks": (
        lambda me, gone: [gone, replace(gone, pid=gone.pid + 1)],
        0,
        "of a run whose processes {dead}, {dead_plus_1} are gone",
    ),
    "pid reused": (lambda me, gone: [replace(me, started=me.started - 1)], 0, "of a run whose process {me} is gone"),
    "machine restarted": (lambda me, gone: [replace(me, boot="other")], 0, "of a run whose process {me} is gone"),
    "no record, old": (lambda me, gone: [None], 2 * DAY, "that has no owner record and has not changed for a day"),
    "live": (lambda me, gone: [me], 0, None),
    "live rank and dead rank": (lambda me, gone: [gone, me], 0, None),
    "other host": (lambda me, gone: [replace(gone, host="another-host")], 0, None),
    "other container": (lambda me, gone: [replace(gone, pid_namespace="pid:[1]")], 0, None),
    "no record, recent": (lambda me, gone: [None], DAY / 2, None),
    "dead rank and unrecorded recent rank": (lambda me, gone: [gone, None], DAY / 2, None),
    "no rank folder, recent": (lambda me, gone: [], 0, None),
}


@pytest.mark.parametrize("case", STALE_CASES)
def test_stale_swap_folders_are_removed_at_start_up(tmp_path, capsys, case):
    records, age_s, why = STALE_CASES[case]
    me = this_process()
    gone = replace(me, pid=gone_pid())
    run = write_run(tmp_path, "run-20260101-000000-0badf00d", records(me, gone), age_s)
    half_removed = write_run(tmp_path, "removing-run-20250101-000000-deadbeef", [None])  # its remover died
    folder = SwapFolder(str(tmp_path), 0, "offload_optimizer")
    assert folder.path.exists() and not half_removed.exists()
    lines = [line for line in capsys.readouterr().out.splitlines() if "stale swap folder" in line]
    if why is None:
        assert run.exists() and lines == []
    else:
        why = why.format(dead=gone.pid, dead_plus_1=gone.pid + 1, me=me.pid)
        assert lines == [f" > removed stale swap folder {run} {why}"]
        assert [p.name for p in tmp_path.iterdir()] == [folder.run_root.name]


def _two_ranks_make_folders(root: str) -> dict[str, torch.Tensor]:
    folder = SwapFolder(root, dist.get_rank(), "offload_optimizer")
    dist.barrier()  # both ranks' folders and records are there
    owners = sorted(read_owner(rank_folder).pid for rank_folder in folder.run_root.iterdir())
    dist.barrier()  # until both have looked: a rank's folder goes with its SwapFolder
    return {"owners": torch.tensor(owners)}


def test_ranks_of_one_host_share_the_run_folder_and_remove_a_stale_one_once(tmp_path, capfd):
    gone = replace(this_process(), pid=gone_pid())
    stale = write_run(tmp_path, "run-20260101-000000-0badf00d", [gone, replace(gone, pid=gone.pid + 1)])
    owners = [result["owners"].tolist() for result in run_distributed(_two_ranks_make_folders, 2, str(tmp_path))]
    assert owners[0] == owners[1] and len(set(owners[0])) == 2  # two ranks, two records, one run folder
    assert not stale.exists() and capfd.readouterr().out.count(f"removed stale swap folder {stale} ") == 1
    assert not any(tmp_path.iterdir())  # and each rank's folder went when its process ended


OWN_FOLDER = """
import sys
from megatron.runtime.swap.folder import SwapFolder
folder = SwapFolder(sys.argv[1], 0, "offload_optimizer")
print(folder.path, flush=True)
sys.stdin.read()
"""


def test_a_live_run_keeps_its_folder_until_it_is_killed(tmp_path, capsys):
    with subprocess.Popen(
        [sys.executable, "-c", OWN_FOLDER, str(tmp_path)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            theirs = Path(child.stdout.readline().strip())
            assert theirs.exists()
            assert json.loads((theirs / OWNER_FILE).read_text())["started"] == start_time(child.pid)
            mine = SwapFolder(str(tmp_path), 0, "offload_optimizer")
            assert theirs.exists() and "stale" not in capsys.readouterr().out
        finally:
            child.send_signal(signal.SIGKILL)  # the process ends as the OOM killer would end it
    assert theirs.exists()  # a killed process removes nothing
    SwapFolder(str(tmp_path), 0, "offload_optimizer")
    assert not theirs.parent.exists() and mine.path.exists()
    removed = f" > removed stale swap folder {theirs.parent} of a run whose process {child.pid} is gone\n"
    assert capsys.readouterr().out == removed


EXIT_WHILE_SWAPPING = """
import sys
from pathlib import Path
from tests.test_offload import swapping_engine, train
engine = swapping_engine(Path(sys.argv[1]))
train(engine, 0, 1)
folders = [engine.optimizer.folder.path, engine.strategy.swapper.folder.path]
assert all(any(f.glob("*.swp")) for f in folders)
print(*folders, sep="\\n", flush=True)
raise {exit}
"""


@pytest.mark.parametrize("exit, returncode", [("SystemExit(3)", 3), ("KeyboardInterrupt", -signal.SIGINT)])
def test_swap_folders_are_removed_when_the_interpreter_exits(tmp_path, exit, returncode):
    done = subprocess.run(
        [sys.executable, "-c", EXIT_WHILE_SWAPPING.format(exit=exit), str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == returncode, done.stderr
    folders = [Path(line) for line in done.stdout.splitlines() if line.startswith(str(tmp_path))]
    assert len(folders) == 2 and not any(f.exists() for f in folders)
    assert not any(tmp_path.iterdir())
