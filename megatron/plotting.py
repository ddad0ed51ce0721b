"""Plots as PNG files with numpy alone (no plotting library): lines on an RGB canvas, a 3x5 pixel
font for numbers, a small line chart, and an 8-bit RGB PNG writer.
"""

import itertools
import struct
import zlib

import numpy as np

Color = tuple[int, int, int]
BLACK: Color = (0, 0, 0)
# 3x5 glyphs, one row of three bits per string, for axis labels and legend numbers
GLYPHS = {
    "0": ("111", "101", "101", "101", "111"), "1": ("010", "110", "010", "010", "111"),
    "2": ("111", "001", "111", "100", "111"), "3": ("111", "001", "111", "001", "111"),
    "4": ("101", "101", "111", "001", "001"), "5": ("111", "100", "111", "001", "111"),
    "6": ("111", "100", "111", "101", "111"), "7": ("111", "001", "010", "010", "010"),
    "8": ("111", "101", "111", "101", "111"), "9": ("111", "101", "111", "001", "111"),
    ".": ("000", "000", "000", "000", "010"), "-": ("000", "000", "111", "000", "000"),
}


def draw_line(image: np.ndarray, x0: float, y0: float, x1: float, y1: float, color: Color) -> None:
    count = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    xs = np.rint(np.linspace(x0, x1, count)).astype(int).clip(0, image.shape[1] - 1)
    ys = np.rint(np.linspace(y0, y1, count)).astype(int).clip(0, image.shape[0] - 1)
    image[ys, xs] = color


def draw_text(image: np.ndarray, x: int, y: int, text: str, color: Color = BLACK, scale: int = 2) -> None:
    """Digits, '.' and '-' with their top-left corner at (x, y); other characters leave a gap."""
    for i, char in enumerate(text):
        for row, bits in enumerate(GLYPHS.get(char, ("000",) * 5)):
            for col, bit in enumerate(bits):
                if bit == "1":
                    top, left = y + row * scale, x + (4 * i + col) * scale
                    image[max(top, 0):top + scale, max(left, 0):left + scale] = color


def line_chart(curves: list[tuple[list[tuple[float, float]], Color]], width: int = 800, height: int = 500) -> np.ndarray:
    """Curves of (x, y) points on shared linear axes, five labelled ticks on each, and a legend
    numbering the curves 1, 2, ... in their colours (the caption says what each number is)."""
    image = np.full((height, width, 3), 255, dtype=np.uint8)
    left, right, top, bottom = 70, width - 130, 20, height - 40
    xs = [x for points, _ in curves for x, _ in points]
    ys = [y for points, _ in curves for _, y in points]
    lo_x, hi_x = min(xs), max(max(xs), min(xs) + 1e-9)
    lo_y, hi_y = min(ys), max(max(ys), min(ys) + 1e-9)

    def to_px(x: float, y: float) -> tuple[float, float]:
        return (left + (x - lo_x) / (hi_x - lo_x) * (right - left),
                bottom - (y - lo_y) / (hi_y - lo_y) * (bottom - top))

    draw_line(image, left, bottom, right, bottom, BLACK)
    draw_line(image, left, top, left, bottom, BLACK)
    for i in range(5):
        x_value, y_value = lo_x + i * (hi_x - lo_x) / 4, lo_y + i * (hi_y - lo_y) / 4
        x, _ = to_px(x_value, lo_y)
        _, y = to_px(lo_x, y_value)
        draw_line(image, x, bottom, x, bottom + 6, BLACK)
        draw_text(image, int(x) - 12, bottom + 12, f"{x_value:.0f}")
        draw_line(image, left - 6, y, left, y, BLACK)
        draw_text(image, 8, int(y) - 5, f"{y_value:.2f}")
    for number, (points, color) in enumerate(curves, start=1):
        for (x0, y0), (x1, y1) in itertools.pairwise([to_px(x, y) for x, y in points]):
            for offset in (0, 1):  # two pixels wide, so the colours stay distinguishable
                draw_line(image, x0, y0 + offset, x1, y1 + offset, color)
        legend_y = top + 20 * number
        image[legend_y - 2:legend_y + 2, right + 20:right + 60] = color
        draw_text(image, right + 70, legend_y - 5, str(number))
    return image


def png_bytes(image: np.ndarray) -> bytes:
    """8-bit RGB PNG: signature, IHDR, one zlib IDAT (filter 0 on every row), IEND."""
    height, width, _ = image.shape

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    rows = np.concatenate([np.zeros((height, 1), dtype=np.uint8), image.reshape(height, width * 3)], axis=1)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows.tobytes(), 9))
            + chunk(b"IEND", b""))
