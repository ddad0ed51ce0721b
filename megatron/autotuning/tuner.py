"""The search: candidates from space.py in grid order (gridsearch) or shuffled (random), each run as
a trial (trial.py) until `tuner_num_trials` have run or `tuner_early_stopping` in a row brought no
better metric; then the ranked table, the best ds_config (`ds_config_optimal.json`) and the best
command (`cmd_optimal.txt`) in `results_dir`, as DeepSpeed's autotuner writes them."""

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatron.autotuning.space import GB, Candidate
from megatron.autotuning.trial import TrialResult
from megatron.runtime.config.schema import AutotuningConfig

RunTrial = Callable[[Candidate], TrialResult]


@dataclass(frozen=True)
class Search:
    results: list[TrialResult]  # in the order they ran (pruned ones first)
    best: TrialResult | None
    stopped_early: bool


def search(found: list[Candidate], tuning: AutotuningConfig, run: RunTrial, seed: int = 1234) -> Search:
    results = [TrialResult(c.setting, c.estimated_bytes, f"pruned: {c.pruned}") for c in found if c.pruned]
    runnable = [c for c in found if c.pruned is None]
    if tuning.tuner_type == "random":
        random.Random(seed).shuffle(runnable)
    best: TrialResult | None = None
    since_better, stopped_early = 0, False
    for index, candidate in enumerate(runnable):
        if index == tuning.tuner_num_trials:
            break
        if since_better >= tuning.tuner_early_stopping:
            stopped_early = True
            break
        result = run(candidate)
        results.append(result)
        value = result.metric(tuning.metric)
        if value is not None and (best is None or value > (best.metric(tuning.metric) or 0.0)):
            best, since_better = result, 0
        else:
            since_better += 1
    return Search(results, best, stopped_early)


def ranked_table(found: Search, metric: str) -> str:
    ran = sorted((r for r in found.results if r.status == "ok"), key=lambda r: -(r.metric(metric) or 0.0))
    rest = [r for r in found.results if r.status != "ok"]
    header = (
        f"{'rank':>4}  {'trial':<30}{'ZeRO':>5}{'mbs':>5}{'ckpt':>6}{'offload':>8}{'ep':>4}{'est. GB':>9}"
        f"{'ms/iter':>10}{'samples/s':>11}{'TFLOP/s':>9}  status"
    )
    lines = [header]
    for place, r in enumerate(ran + rest, 1):
        s = r.setting
        timing = (
            f"{r.ms_per_iteration:>10.1f}{r.samples_per_second:>11.2f}{r.tflops:>9.3f}"
            if r.status == "ok"
            else " " * 30
        )
        lines.append(
            f"{place if r.status == 'ok' else '-':>4}  {s.name:<30}{s.zero_stage:>5}{s.micro_batch_size:>5}"
            f"{'on' if s.checkpoint_activations else 'off':>6}{'cpu' if s.offload_optimizer else 'none':>8}"
            f"{s.ep_size:>4}{r.estimated_bytes / GB:>9.2f}{timing}  {r.status}"
        )
    return "\n".join(lines)


def write_results(folder: Path, found: Search, metric: str, best_config: dict | None, best_command: str | None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.txt").write_text(ranked_table(found, metric) + "\n")
    if best_config is not None and best_command is not None:
        (folder / "ds_config_optimal.json").write_text(json.dumps(best_config, indent=2) + "\n")
        (folder / "cmd_optimal.txt").write_text(best_command + "\n")
