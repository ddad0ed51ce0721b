"""megatron/plotting.py and the study tools' plots: named legends and titled axes drawn from a
made-up JSON record, the PNG written, and the one-sentence error where matplotlib is missing."""

import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
from matplotlib.figure import Figure

from megatron.plotting import MISSING, Curve, Mark, line_figure, save_png
from tools import balancing_study, quality_study

REPO = Path(__file__).resolve().parent.parent
# the record main() saves: the untrained evaluation at iteration 0 is left off the plot
QUALITY = {
    "train_tokens": 3072,
    "runs": [
        {"number": 1, "label": "dense", "validation": [[0, 8.3], [1, 7.2], [3, 6.9]]},
        {"number": 2, "label": "MoE (8 experts, top-1)", "validation": [[0, 8.3], [1, 7.1], [3, 6.8]]},
    ],
}
BALANCING = {
    "train_iters": 10,
    "runs": [
        {
            "label": "softmax top-2, aux loss 0.01",
            "validation": [[0, 8.4], [10, 6.7]],
            "imbalance": [[5, 1.4], [10, 1.3]],
        },
        {
            "label": "sigmoid top-2, expert bias",
            "validation": [[0, 8.4], [10, 6.6]],
            "imbalance": [[5, 2.0], [10, 1.2]],
        },
    ],
}


def legend(figure: Figure) -> list[str]:
    return [text.get_text() for text in figure.legends[0].get_texts()]


def test_the_quality_plot_names_every_run_and_titles_its_axes() -> None:
    figure = quality_study.figure(QUALITY)
    axes = figure.axes[0]
    assert legend(figure) == ["1 dense", "2 MoE (8 experts, top-1)"]
    assert axes.get_xlabel() == "iteration (8 x 128 tokens each)"
    assert axes.get_ylabel() == "validation loss (cross-entropy, nats per token)"
    assert axes.get_title() == "Validation loss, 3,072 training tokens per run"
    assert [list(line.get_xdata()) for line in axes.get_lines()] == [[1, 3], [1, 3]]


def test_the_balancing_plots_name_every_run_and_title_their_axes(tmp_path: Path) -> None:
    figures = balancing_study.figures(BALANCING)
    assert list(figures) == ["_imbalance", "_loss"]
    for figure in figures.values():
        assert legend(figure) == ["1 softmax top-2, aux loss 0.01", "2 sigmoid top-2, expert bias"]
        assert figure.axes[0].get_xlabel() == "iteration (16 x 256 tokens each)"
    assert figures["_imbalance"].axes[0].get_ylabel() == "max/mean tokens per expert (mean over MoE layers)"
    assert [list(line.get_ydata()) for line in figures["_imbalance"].axes[0].get_lines()] == [[1.4, 1.3], [2.0, 1.2]]
    assert figures["_loss"].axes[0].get_ylabel() == "validation loss (cross-entropy, nats per token)"
    balancing_study.write_plots(BALANCING, tmp_path / "balancing")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["balancing_imbalance.png", "balancing_loss.png"]


def test_a_figure_is_saved_as_a_png_whatever_the_suffix(tmp_path: Path) -> None:
    figure = line_figure(
        [Curve("loss", [(1.0, 3.0), (2.0, 2.0), (3.0, float("nan")), (4.0, 1.0)])],
        title="t",
        x_title="step",
        y_title="loss",
        marks=[Mark(2.0, "best")],
    )
    assert legend(figure) == ["loss", "best"]
    path = tmp_path / "plot.img"
    save_png(figure, path)
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    height, width, _ = matplotlib.image.imread(path, format="png").shape
    assert height > 0 and width > 0


def without_matplotlib(script: str, *args: str) -> subprocess.CompletedProcess:
    """`script` run with matplotlib unimportable: None in sys.modules makes every import of it fail."""
    prelude = "import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; "
    return subprocess.run(
        [sys.executable, "-c", prelude + "runpy.run_path(sys.argv[0], run_name='__main__')", script, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


@pytest.mark.parametrize(
    "script, args",
    [
        ("tools/lr_range_test.py", ["--toy", "--lr_range_test_output", "{tmp}/range.png"]),
        ("tools/quality_study.py", ["--output", "{tmp}/quality", "--work-dir", "{tmp}/work"]),
        # no corpus in the demo folder either: the missing plotter is said first, before any check of the runs
        ("tools/balancing_study.py", ["--output", "{tmp}/balancing", "--demo-dir", "{tmp}"]),
    ],
)
def test_without_matplotlib_a_plotting_tool_says_how_to_install_it(
    script: str, args: list[str], tmp_path: Path
) -> None:
    done = without_matplotlib(script, *[arg.format(tmp=tmp_path) for arg in args])
    assert done.returncode == 1 and done.stderr == f"error: {MISSING}\n" and done.stdout == ""
    assert list(tmp_path.iterdir()) == []  # it stops before any run or output


def test_without_matplotlib_making_a_figure_raises_the_install_sentence() -> None:
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from megatron.errors import UserError\n"
        "from megatron.plotting import new_figure\n"
        "try:\n    new_figure()\nexcept UserError as error:\n    print(error)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0 and done.stdout == f"{MISSING}\n"
