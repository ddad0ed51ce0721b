"""Line plots as PNG files with matplotlib, an optional dependency (the `plot` extra): every curve
and mark named in a legend, every axis titled. matplotlib is imported only when a figure is made,
so the tools that plot still parse flags and print help without it, and it draws with the Agg
backend alone, which renders to files and never opens a window.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron.errors import UserError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MISSING = "plotting needs matplotlib; pip install matplotlib (or the package's plot extra: pip install .[plot])"
SIZE_INCHES, DPI = (8.0, 5.5), 120


@dataclass(frozen=True)
class Curve:
    """(x, y) points joined by a line, named `label` in the legend; a non-finite y breaks the line."""

    label: str
    points: Sequence[tuple[float, float]]


@dataclass(frozen=True)
class Mark:
    """A dashed vertical line at `x` across the plot, named `label` in the legend."""

    x: float
    label: str


def new_figure() -> "Figure":
    """An empty figure on the Agg canvas; UserError with the install sentence without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(MISSING) from None
    # no pyplot: a figure made this way is not kept in a global registry and never shown
    figure = Figure(figsize=SIZE_INCHES, dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def require_matplotlib() -> None:
    """Raise the install sentence now: a tool calls this before a long run, not after it."""
    new_figure()


def line_figure(
    curves: Sequence[Curve],
    *,
    title: str,
    x_title: str,
    y_title: str,
    log_x: bool = False,
    y_range: tuple[float, float] | None = None,
    marks: Sequence[Mark] = (),
    show_points: bool = False,
) -> "Figure":
    """The curves on one pair of axes (x linear or log10), the marks as dashed vertical lines in
    colours after the curves', and the legend below the plot, where it cannot hide a line.
    `show_points` draws a dot at each point, for curves of a few evaluations."""
    figure = new_figure()
    axes = figure.add_subplot()
    for curve in curves:
        xs, ys = [x for x, _ in curve.points], [y for _, y in curve.points]
        axes.plot(xs, ys, label=curve.label, marker="o" if show_points else "", markersize=3)
    for number, mark in enumerate(marks, start=len(curves)):
        axes.axvline(mark.x, color=f"C{number}", linestyle="--", label=mark.label)
    if log_x:
        axes.set_xscale("log")
    if y_range is not None:
        axes.set_ylim(*y_range)
    axes.set_title(title)
    axes.set_xlabel(x_title)
    axes.set_ylabel(y_title)
    axes.grid(alpha=0.3)
    figure.legend(loc="outside lower center", ncols=2 if len(curves) + len(marks) > 3 else 1, frameon=False)
    return figure


def save_png(figure: "Figure", path: Path) -> None:
    """Write `figure` to `path` as a PNG, whatever the file's suffix."""
    figure.savefig(path, format="png")
