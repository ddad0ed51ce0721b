"""Plots as PNG files with numpy alone (no plotting library, and no font file): lines on an RGB
canvas, a 3x5 pixel font (digits, capital letters, a little punctuation), a line chart with axis
titles, tick labels and a legend row, and an 8-bit RGB PNG writer.
"""

import itertools
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Color = tuple[int, int, int]
BLACK: Color = (0, 0, 0)
BACKGROUND: Color = (255, 255, 255)
# 3x5 glyphs, one row of three bits per string; text is drawn in capitals
GLYPHS = {
    "0": ("111", "101", "101", "101", "111"),
    "1": ("010", "110", "010", "010", "111"),
    "2": ("111", "001", "111", "100", "111"),
    "3": ("111", "001", "111", "001", "111"),
    "4": ("101", "101", "111", "001", "001"),
    "5": ("111", "100", "111", "001", "111"),
    "6": ("111", "100", "111", "101", "111"),
    "7": ("111", "001", "010", "010", "010"),
    "8": ("111", "101", "111", "101", "111"),
    "9": ("111", "101", "111", "001", "111"),
    "A": ("010", "101", "111", "101", "101"),
    "B": ("110", "101", "110", "101", "110"),
    "C": ("011", "100", "100", "100", "011"),
    "D": ("110", "101", "101", "101", "110"),
    "E": ("111", "100", "110", "100", "111"),
    "F": ("111", "100", "110", "100", "100"),
    "G": ("011", "100", "101", "101", "011"),
    "H": ("101", "101", "111", "101", "101"),
    "I": ("111", "010", "010", "010", "111"),
    "J": ("001", "001", "001", "101", "010"),
    "K": ("101", "101", "110", "101", "101"),
    "L": ("100", "100", "100", "100", "111"),
    "M": ("101", "111", "111", "101", "101"),
    "N": ("110", "101", "101", "101", "101"),
    "O": ("010", "101", "101", "101", "010"),
    "P": ("110", "101", "110", "100", "100"),
    "Q": ("010", "101", "101", "110", "011"),
    "R": ("110", "101", "110", "101", "101"),
    "S": ("011", "100", "010", "001", "110"),
    "T": ("111", "010", "010", "010", "010"),
    "U": ("101", "101", "101", "101", "111"),
    "V": ("101", "101", "101", "101", "010"),
    "W": ("101", "101", "111", "111", "101"),
    "X": ("101", "101", "010", "101", "101"),
    "Y": ("101", "101", "010", "010", "010"),
    "Z": ("111", "001", "010", "100", "111"),
    ".": ("000", "000", "000", "000", "010"),
    "-": ("000", "000", "111", "000", "000"),
    "+": ("000", "010", "111", "010", "000"),
    "=": ("000", "111", "000", "111", "000"),
    "(": ("010", "100", "100", "100", "010"),
    ")": ("010", "001", "001", "001", "010"),
    ",": ("000", "000", "000", "010", "100"),
    ":": ("000", "010", "000", "010", "000"),
    "/": ("001", "001", "010", "100", "100"),
    "%": ("101", "001", "010", "100", "101"),
    "_": ("000", "000", "000", "000", "111"),
    " ": ("000",) * 5,
}
# the chart's margins around the plot box: y tick labels and title on the left, x tick labels
# and title below, the legend row above
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 100, 20, 40, 60


@dataclass(frozen=True)
class Mark:
    """A vertical line at `x` across the plot box, named in the legend row."""

    x: float
    color: Color
    label: str


def draw_line(image: np.ndarray, x0: float, y0: float, x1: float, y1: float, color: Color) -> None:
    count = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    xs = np.rint(np.linspace(x0, x1, count)).astype(int).clip(0, image.shape[1] - 1)
    ys = np.rint(np.linspace(y0, y1, count)).astype(int).clip(0, image.shape[0] - 1)
    image[ys, xs] = color


def text_mask(text: str, scale: int = 2) -> np.ndarray:
    """Pixels of `text` in capitals, one pixel column between glyphs; a character without a
    glyph is drawn as a filled box, so a missing glyph shows instead of leaving a silent gap."""
    cells = [GLYPHS.get(char, ("111",) * 5) for char in text.upper()]
    bits = np.zeros((5, max(4 * len(cells) - 1, 0)), dtype=bool)
    for i, glyph in enumerate(cells):
        bits[:, 4 * i : 4 * i + 3] = [[bit == "1" for bit in row] for row in glyph]
    return bits.repeat(scale, axis=0).repeat(scale, axis=1)


def paste(image: np.ndarray, mask: np.ndarray, x: int, y: int, color: Color) -> None:
    """Colour the pixels of `mask` with its top-left corner at (x, y), clipped to the image."""
    top, left = max(y, 0), max(x, 0)
    bottom, right = min(y + mask.shape[0], image.shape[0]), min(x + mask.shape[1], image.shape[1])
    if bottom > top and right > left:
        image[top:bottom, left:right][mask[top - y : bottom - y, left - x : right - x]] = color


def draw_text(image: np.ndarray, x: int, y: int, text: str, color: Color = BLACK, scale: int = 2) -> None:
    """`text` with its top-left corner at (x, y)."""
    paste(image, text_mask(text, scale), x, y, color)


def plot_box(width: int, height: int) -> tuple[int, int, int, int]:
    """(left, right, top, bottom) pixel bounds of a chart's plot area."""
    return MARGIN_LEFT, width - MARGIN_RIGHT, MARGIN_TOP, height - MARGIN_BOTTOM


def tick_label(value: float, log: bool = False) -> str:
    if log:  # one significant digit: the ticks are 1, 2 or 5 times a power of ten
        return f"{value:.0e}"
    if value == int(value) and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.3g}"


def log_ticks(lo: float, hi: float) -> list[float]:
    """Decades inside [lo, hi]; over a shorter span 1-2-5 steps, then every digit, so that at
    least two ticks carry a label."""
    decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
    for mantissas in ((1,), (1, 2, 5), range(1, 10)):
        ticks = [m * 10.0**d for d in decades for m in mantissas if lo <= m * 10.0**d <= hi]
        if len(ticks) >= 2:
            return ticks
    return [lo, hi]


def line_chart(
    curves: list[tuple[list[tuple[float, float]], Color]],
    width: int = 800,
    height: int = 500,
    *,
    x_title: str = "",
    y_title: str = "",
    log_x: bool = False,
    y_range: tuple[float, float] | None = None,
    marks: Sequence[Mark] = (),
) -> np.ndarray:
    """Curves of (x, y) points on shared axes (x linear or log10), five labelled ticks on y,
    labelled ticks on x, axis titles, and a legend row above the plot: the curves numbered 1, 2, ...
    in their colours when there are several (the caption says what each number is), then the marks.
    Points outside `y_range` are drawn at its edge; non-finite points break the curve."""
    image = np.full((height, width, 3), BACKGROUND, dtype=np.uint8)
    left, right, top, bottom = plot_box(width, height)
    finite = [(x, y) for points, _ in curves for x, y in points if math.isfinite(y)]
    xs, ys = [x for x, _ in finite], [y for _, y in finite]
    scale_x = math.log10 if log_x else float
    lo_x, hi_x = scale_x(min(xs)), scale_x(max(xs))
    hi_x = max(hi_x, lo_x + 1e-9)
    lo_y, hi_y = y_range or (min(ys), max(ys))
    hi_y = max(hi_y, lo_y + 1e-9)

    def px(x: float) -> float:
        return left + (scale_x(x) - lo_x) / (hi_x - lo_x) * (right - left)

    def py(y: float) -> float:
        return bottom - (min(max(y, lo_y), hi_y) - lo_y) / (hi_y - lo_y) * (bottom - top)

    draw_line(image, left, bottom, right, bottom, BLACK)
    draw_line(image, left, top, left, bottom, BLACK)
    x_ticks = log_ticks(10**lo_x, 10**hi_x) if log_x else [lo_x + i * (hi_x - lo_x) / 4 for i in range(5)]
    for value in x_ticks:
        draw_line(image, px(value), bottom, px(value), bottom + 6, BLACK)
        label = text_mask(tick_label(value, log_x))
        paste(image, label, int(px(value)) - label.shape[1] // 2, bottom + 12, BLACK)
    for value in (lo_y + i * (hi_y - lo_y) / 4 for i in range(5)):
        draw_line(image, left - 6, py(value), left, py(value), BLACK)
        label = text_mask(tick_label(value))
        paste(image, label, left - 10 - label.shape[1], int(py(value)) - label.shape[0] // 2, BLACK)
    title = text_mask(x_title)
    paste(image, title, (left + right - title.shape[1]) // 2, bottom + 36, BLACK)
    title = np.rot90(text_mask(y_title))  # read from bottom to top
    paste(image, title, 6, (top + bottom - title.shape[0]) // 2, BLACK)
    for points, color in curves:
        runs = itertools.groupby(points, key=lambda point: math.isfinite(point[1]))
        for run in (list(run) for ok, run in runs if ok):
            for (x0, y0), (x1, y1) in itertools.pairwise(run):
                for offset in (0, 1):  # two pixels wide, so the colours stay distinguishable
                    draw_line(image, px(x0), py(y0) + offset, px(x1), py(y1) + offset, color)
    for mark in marks:
        if lo_x <= scale_x(mark.x) <= hi_x:
            draw_line(image, px(mark.x), top, px(mark.x), bottom, mark.color)
    legend = [(str(number), color) for number, (_, color) in enumerate(curves, start=1)] if len(curves) > 1 else []
    x = left
    for label, color in legend + [(mark.label, mark.color) for mark in marks]:
        image[top - 22 : top - 18, x : x + 24] = color
        draw_text(image, x + 30, top - 25, label)
        x += 30 + text_mask(label).shape[1] + 24
    return image


def png_bytes(image: np.ndarray) -> bytes:
    """8-bit RGB PNG: signature, IHDR, one zlib IDAT (filter 0 on every row), IEND."""
    height, width, _ = image.shape

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    rows = np.concatenate([np.zeros((height, 1), dtype=np.uint8), image.reshape(height, width * 3)], axis=1)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows.tobytes(), 9))
        + chunk(b"IEND", b"")
    )
