"""One autotuning trial: pretrain_gpt.py with the setting's flags and ds_config for
`end_profile_step` iterations, in its own process (torchrun for several ranks), so that a crash or
an out-of-memory is that trial's row and not the tuner's end. The metric comes from the run's own
log lines (one per iteration), over the iterations after `start_profile_step`."""

import json
import os
import re
import resource
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron.autotuning.space import Setting
from megatron.parallel import free_port
from megatron.runtime.config.schema import AutotuningConfig

LINE = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+) \|.*?TFLOP/s: ([0-9.]+) \|"
)
OUT_OF_MEMORY = ("out of memory", "can't allocate memory", "cannot allocate memory", "memoryerror", "bad_alloc")
# the flags a setting decides (the ZeRO stage: in its ds_config), and whether each takes a value
SETTING_FLAGS = {
    "--micro-batch-size": True,
    "--checkpoint-activations": False,
    "--recompute-activations": False,
    "--moe-expert-parallel-size": True,
    "--zero-stage": True,
    "--deepspeed": False,
    "--deepspeed_config": True,
}
# and those a short trial sets itself
TRIAL_FLAGS = {
    **SETTING_FLAGS,
    "--train-iters": True,
    "--log-interval": True,
    "--eval-interval": True,
    "--eval-iters": True,
    "--eval-at-start": False,
    "--save": True,
    "--load": True,
    "--save-interval": True,
    "--tensorboard-dir": True,
    "--exit-interval": True,
    "--exit-duration-in-mins": True,
}


@dataclass(frozen=True)
class TrialResult:
    setting: Setting
    estimated_bytes: float
    status: str  # "ok", "pruned: ...", "out of memory", "failed: ...", "timed out"
    ms_per_iteration: float | None = None
    samples_per_second: float | None = None
    tflops: float | None = None

    def metric(self, name: str) -> float | None:
        """The value to rank by, larger is better (latency negated); None when it did not run."""
        if self.status != "ok":
            return None
        return {
            "throughput": self.samples_per_second,
            "latency": -(self.ms_per_iteration or 0.0),
            "flops": self.tflops,
        }[name]


def without(flags: list[str], dropped: dict[str, bool]) -> list[str]:
    """`flags` less the `dropped` ones (and the value of each that takes one)."""
    kept, skip = [], False
    for index, flag in enumerate(flags):
        if skip:
            skip = False
            continue
        if flag in dropped:
            skip = dropped[flag] and index + 1 < len(flags) and not flags[index + 1].startswith("--")
            continue
        kept.append(flag)
    return kept


def setting_flags(base: list[str], setting: Setting, ds_config: Path) -> list[str]:
    """The command's flags with the setting's: what the best one's command line is."""
    flags = without(base, SETTING_FLAGS) + [
        "--micro-batch-size", str(setting.micro_batch_size),
        "--moe-expert-parallel-size", str(setting.ep_size),
        "--deepspeed", "--deepspeed_config", str(ds_config),
    ]  # fmt: skip
    return flags + (["--checkpoint-activations"] if setting.checkpoint_activations else [])


def trial_flags(
    base: list[str], setting: Setting, ds_config: Path, tuning: AutotuningConfig, train_iters: int
) -> list[str]:
    """A trial's flags: the setting's, `end_profile_step` iterations logged one by one, no evaluation,
    no checkpoint, and the real run's LR decay (these are its first steps)."""
    flags = setting_flags(without(base, TRIAL_FLAGS), setting, ds_config)
    if "--lr-decay-iters" not in flags and "--lr-decay-samples" not in flags:
        flags += ["--lr-decay-iters", str(train_iters)]
    return flags + [
        "--train-iters", str(tuning.end_profile_step),
        "--log-interval", "1",
        "--eval-iters", "0",
        "--eval-interval", str(tuning.end_profile_step + 1),
    ]  # fmt: skip


def trial_ds_config(base: dict, setting: Setting) -> dict:
    config = {
        k: v for k, v in base.items() if k not in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    }
    config.pop("train_batch_size", None)  # the flags' global batch decides it
    zero = dict(config.get("zero_optimization", {}), stage=setting.zero_stage)
    if setting.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    config["zero_optimization"] = zero
    config["autotuning"] = {**config.get("autotuning", {}), "enabled": False}
    return config


def _limit_memory(limit_bytes: int | None):
    if limit_bytes is None:
        return None
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))


def launcher(nproc: int, *torchrun_flags: str) -> list[str]:
    """How a command starts `nproc` ranks on this node: python for one, torchrun for more."""
    if nproc == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", *torchrun_flags]


def run_trial(
    script: str,
    flags: list[str],
    ds_config: dict,
    setting: Setting,
    estimated: float,
    folder: Path,
    tuning: AutotuningConfig,
    nproc: int,
    memory_limit_bytes: int | None,
    timeout_s: float,
) -> TrialResult:
    """Run the trial in `folder` (its ds_config, command, log and result land there)."""
    folder.mkdir(parents=True, exist_ok=True)
    done = folder / "result.json"
    if done.exists() and not tuning.overwrite:
        return result_from_json(json.loads(done.read_text()))
    (folder / "ds_config.json").write_text(json.dumps(ds_config, indent=2) + "\n")
    command = [*launcher(nproc, f"--master-port={free_port()}"), script, *flags]
    (folder / "cmd.txt").write_text(" ".join(command) + "\n")
    try:
        with open(folder / "stdout.log", "w") as out, open(folder / "stderr.log", "w") as err:
            finished = subprocess.run(
                command, stdout=out, stderr=err, timeout=timeout_s, preexec_fn=_limit_memory(memory_limit_bytes),
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip
        result = _read_result(finished.returncode, folder, setting, estimated, tuning)
    except subprocess.TimeoutExpired:
        result = TrialResult(setting, estimated, f"timed out after {timeout_s:.0f} s")
    done.write_text(json.dumps(asdict(result), indent=2) + "\n")
    return result


def _read_result(code: int, folder: Path, setting: Setting, estimated: float, tuning: AutotuningConfig) -> TrialResult:
    out, err = (folder / "stdout.log").read_text(), (folder / "stderr.log").read_text()
    if code != 0:
        text = (out + err).lower()
        if code == -9 or any(sign in text for sign in OUT_OF_MEMORY):  # -9: the kernel's OOM killer
            return TrialResult(setting, estimated, "out of memory")
        last = next((line for line in reversed(err.splitlines()) if line.strip()), f"exit status {code}")
        return TrialResult(setting, estimated, f"failed: {last.strip()[:200]}")
    measured = [(float(ms), float(tf)) for it, ms, tf in LINE.findall(out) if int(it) > tuning.start_profile_step]
    if not measured:
        return TrialResult(setting, estimated, "failed: no iteration after start_profile_step in its log")
    ms = sum(m for m, _ in measured) / len(measured)
    tflops = sum(t for _, t in measured) / len(measured)
    samples = float(re.search(r"global batch size:\s+(\d+)", out).group(1))
    return TrialResult(setting, estimated, "ok", ms, 1000.0 * samples / ms, tflops)


def result_from_json(data: dict) -> TrialResult:
    return TrialResult(**{**data, "setting": Setting(**data["setting"])})
