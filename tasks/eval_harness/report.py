"""The markdown table of zero-shot scores, laid out as the DeepSpeed-MoE paper's table: one row
per model, the paper's tasks first in its order (LAMBADA, PIQA, BoolQ, RACE-h, TriviaQA, WebQs),
then any other task; accuracy-type scores in percent. Works on lm-eval's results JSON."""

from typing import Any

PAPER_COLUMNS = {
    "lambada_openai": "LAMBADA",
    "lambada_standard": "LAMBADA",
    "lambada_local": "LAMBADA (local)",
    "piqa": "PIQA",
    "piqa_local": "PIQA (local)",
    "boolq": "BoolQ",
    "race": "RACE-h",
    "triviaqa": "TriviaQA",
    "webqs": "WebQs",
}
METRICS = ("acc", "exact_match", "em", "acc_norm")  # the first one a task reports is shown


def headline(task_results: dict[str, Any]) -> tuple[str, float] | None:
    """The task's main metric and its value, from lm-eval's "metric,filter" keys."""
    for metric in METRICS:
        for key, value in task_results.items():
            if key.split(",")[0] == metric and isinstance(value, (int, float)):
                return metric, float(value)
    return None


def markdown_table(results: dict[str, Any], model_name: str) -> str:
    order = list(PAPER_COLUMNS)
    tasks = sorted(results["results"], key=lambda t: (order.index(t) if t in order else len(order), t))
    scored = [(task, headline(results["results"][task])) for task in tasks]
    scored = [(task, score) for task, score in scored if score is not None]
    header = "| model | " + " | ".join(PAPER_COLUMNS.get(task, task) for task, _ in scored) + " |"
    rule = "| --- |" + " --- |" * len(scored)
    row = f"| {model_name} | " + " | ".join(f"{100 * value:.2f}" for _, (_, value) in scored) + " |"
    metrics = ", ".join(f"{PAPER_COLUMNS.get(task, task)}: {metric}" for task, (metric, _) in scored)
    return f"{header}\n{rule}\n{row}\n\nScores in percent ({metrics}).\n"
