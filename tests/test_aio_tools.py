"""ds_io and ds_nvme_tune on small sizes: they measure, print a pasteable "aio" block, and stop on
bad input with one sentence. Speed itself is measured in benchmarks/aio.py, not asserted here. How
the installed commands exit is in test_tool_behaviour.py; the docs' async-I/O example runs in
test_docs_commands.py."""

import json
from pathlib import Path

import pytest
import torch

from megatron.cli import ds_io, ds_nvme_tune
from megatron.errors import UserError
from megatron.ops import io_bench
from megatron.runtime.config.schema import validate_runtime_config


def _op_built() -> bool:
    try:
        import megatron.ops.aio  # noqa: F401
    except ImportError:
        return False
    return True


needs_op = pytest.mark.skipif(not _op_built(), reason="the async-I/O op is not built: run `pip install -e .`")
REPO = Path(__file__).resolve().parent.parent


def test_parse_size() -> None:
    assert io_bench.parse_size("400M") == 400 << 20
    assert io_bench.parse_size("128k") == 128 << 10
    assert io_bench.parse_size("1G") == 1 << 30
    assert io_bench.parse_size(4096) == 4096
    with pytest.raises(UserError, match="not a positive byte count"):
        io_bench.parse_size("1T")


@needs_op
@pytest.mark.parametrize("op", ["--write", "--read"])
def test_ds_io_measures_and_cleans_up(op: str, tmp_path: Path) -> None:
    result = ds_io.run(
        [
            op,
            "--folder",
            str(tmp_path),
            "--io_size",
            "4M",
            "--block_size",
            "256K",
            "--queue_depth",
            "8",
            "--loops",
            "2",
            "--warmup",
            "0",
        ]
    )
    assert result["op"] == op[2:] and result["io_size"] == 4 << 20
    assert len(result["loops_gbps"]) == 2 and result["gbps"] > 0
    assert list(tmp_path.iterdir()) == []


@needs_op
def test_ds_io_sequential_requests_on_plain_memory(tmp_path: Path) -> None:
    result = ds_io.run(
        [
            "--read",
            "--folder",
            str(tmp_path),
            "--io_size",
            "4M",
            "--requests",
            "4",
            "--sequential_requests",
            "--no-locked",
            "--intra_op_parallelism",
            "2",
            "--loops",
            "1",
        ]
    )
    assert result["gbps"] > 0 and result["requests"] == 4 and not result["locked"]


@needs_op
def test_nvme_tune_prints_aio_block(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = tmp_path / "sweep.json"
    sweep.write_text(
        json.dumps(
            {
                "block_size": ["256K", "1M"],
                "queue_depth": [4],
                "intra_op_parallelism": [1],
                "single_submit": [True],
                "overlap_events": [False],
            }
        )
    )
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    summary = ds_nvme_tune.run(
        [
            "--nvme_dir",
            str(nvme),
            "--sweep_config",
            str(sweep),
            "--io_size",
            "2M",
            "--loops",
            "1",
            "--log_dir",
            str(tmp_path / "logs"),
        ]
    )
    out = capsys.readouterr().out
    assert "best read" in out and "best write" in out
    block = json.loads("{" + out[out.index('"aio": {') :] + "}")["aio"]
    assert block == summary["aio"]  # what the user pastes is what the sweep found
    assert list(block) == ["block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events"]
    assert block["block_size"] in (256 << 10, 1 << 20) and block["queue_depth"] == 4
    assert type(block["intra_op_parallelism"]) is int and block["single_submit"] is True
    assert block["overlap_events"] is False
    # pasted into a runtime config, it is the block NVMe swapping reads
    assert validate_runtime_config({"aio": block}).aio.handle_settings() == block
    log = json.loads((tmp_path / "logs" / "nvme_tune.json").read_text())
    assert len(log["results"]) == 4 and list(nvme.iterdir()) == []


def _error_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        ds_nvme_tune.main(argv)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    return err


@pytest.mark.parametrize("extra", [[], ["--gds"], ["--gpu", "--no_write"]])
def test_nvme_tune_missing_dir_is_one_sentence(
    extra: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no_such_dir"
    err = _error_of(["--nvme_dir", str(missing), *extra], capsys)
    assert f"--nvme_dir {missing} does not exist" in err  # the folder is checked before anything else


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the messages of a machine without a GPU")
@pytest.mark.parametrize(
    "flag, message", [("--gds", "GPUDirect Storage is not available"), ("--gpu", "--gpu needs a CUDA GPU")]
)
def test_nvme_tune_gpu_flags_without_gpu(
    flag: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in _error_of(["--nvme_dir", str(tmp_path), flag], capsys)


def test_nvme_tune_rejects_bad_sweep_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"blocksize": [4096]}))
    with pytest.raises(SystemExit):
        ds_nvme_tune.main(["--nvme_dir", str(tmp_path), "--sweep_config", str(sweep)])
    assert "unknown keys ['blocksize']" in capsys.readouterr().err


@needs_op
def test_gds_is_refused_where_missing() -> None:
    with pytest.raises(UserError, match="GPUDirect Storage is not available"):
        io_bench.handle_factory(gds=True)
