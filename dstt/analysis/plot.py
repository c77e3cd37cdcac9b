"""A dependency-free line plot written as a PNG (zlib + struct only).

Enough for ``dstt history --plot``: axes, ticks with labels, one coloured
polyline per series, a legend and a title, drawn on an RGB canvas with a
built-in 3×5 pixel font. Non-finite values leave gaps in a line.

>>> import tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "p.png")
>>> line_plot([("w", [0, 1, 2], [1.0, 0.5, 0.25])], path, title="norm")
>>> open(path, "rb").read(8) == PNG_SIGNATURE
True
"""

from __future__ import annotations

import math
import struct
import zlib
from typing import Sequence

import numpy as np

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]

_FONT_SRC = {
    "0": "111 101 101 101 111", "1": "010 110 010 010 111", "2": "111 001 111 100 111",
    "3": "111 001 111 001 111", "4": "101 101 111 001 001", "5": "111 100 111 001 111",
    "6": "111 100 111 101 111", "7": "111 001 010 010 010", "8": "111 101 111 101 111",
    "9": "111 101 111 001 111", "A": "010 101 111 101 101", "B": "110 101 110 101 110",
    "C": "011 100 100 100 011", "D": "110 101 101 101 110", "E": "111 100 110 100 111",
    "F": "111 100 110 100 100", "G": "011 100 101 101 011", "H": "101 101 111 101 101",
    "I": "111 010 010 010 111", "J": "001 001 001 101 010", "K": "101 101 110 101 101",
    "L": "100 100 100 100 111", "M": "101 111 111 101 101", "N": "110 101 101 101 101",
    "O": "010 101 101 101 010", "P": "110 101 110 100 100", "Q": "010 101 101 110 011",
    "R": "110 101 110 101 101", "S": "011 100 010 001 110", "T": "111 010 010 010 010",
    "U": "101 101 101 101 111", "V": "101 101 101 101 010", "W": "101 101 111 111 101",
    "X": "101 101 010 101 101", "Y": "101 101 010 010 010", "Z": "111 001 010 100 111",
    ".": "000 000 000 000 010", "-": "000 000 111 000 000", "+": "000 010 111 010 000",
    "_": "000 000 000 000 111", "/": "001 001 010 100 100", ":": "000 010 000 010 000",
    "(": "010 100 100 100 010", ")": "010 001 001 001 010", "@": "111 101 111 100 111",
    "=": "000 111 000 111 000", "*": "101 010 101 000 000", ",": "000 000 000 010 100",
    "[": "110 100 100 100 110", "]": "011 001 001 001 011", "%": "101 001 010 100 101",
    " ": "000 000 000 000 000",
}
_FONT = {c: np.array([[ch == "1" for ch in row] for row in rows.split()], dtype=bool) for c, rows in _FONT_SRC.items()}
SCALE = 2  # font pixels per glyph pixel


class Canvas:
    """An RGB image with the few drawing primitives a line plot needs."""

    def __init__(self, width: int, height: int) -> None:
        self.px = np.full((height, width, 3), 255, dtype=np.uint8)
        self.w, self.h = width, height

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int]) -> None:
        x0, x1 = max(0, min(x0, x1)), min(self.w, max(x0, x1) + 1)
        y0, y1 = max(0, min(y0, y1)), min(self.h, max(y0, y1) + 1)
        self.px[y0:y1, x0:x1] = color

    def line(self, x0: float, y0: float, x1: float, y1: float, color: tuple[int, int, int], width: int = 1) -> None:
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        xs = np.rint(np.linspace(x0, x1, n)).astype(np.int64)
        ys = np.rint(np.linspace(y0, y1, n)).astype(np.int64)
        for dx in range(width):
            for dy in range(width):
                x, y = xs + dx - width // 2, ys + dy - width // 2
                ok = (x >= 0) & (x < self.w) & (y >= 0) & (y < self.h)
                self.px[y[ok], x[ok]] = color

    def text(self, x: int, y: int, s: str, color: tuple[int, int, int] = (0, 0, 0), anchor: str = "left") -> None:
        width = text_width(s)
        if anchor == "right":
            x -= width
        elif anchor == "center":
            x -= width // 2
        for ch in s.upper():
            glyph = _FONT.get(ch, _FONT["*"])
            big = np.kron(glyph, np.ones((SCALE, SCALE), dtype=bool))
            h, w = big.shape
            ys, xs = np.nonzero(big)
            ys, xs = ys + y, xs + x
            ok = (xs >= 0) & (xs < self.w) & (ys >= 0) & (ys < self.h)
            self.px[ys[ok], xs[ok]] = color
            x += w + SCALE

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + self.px[r].tobytes() for r in range(self.h))
        return encode_png(raw, self.w, self.h)


def text_width(s: str) -> int:
    return len(s) * 4 * SCALE - SCALE if s else 0


def encode_png(scanlines: bytes, width: int, height: int) -> bytes:
    """A PNG of 8-bit RGB filtered scanlines (filter byte 0 per row)."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return PNG_SIGNATURE + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(scanlines, 6)) + chunk(b"IEND", b"")


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step - 1e-9) * step
    return [start + i * step for i in range(int((hi - start) / step + 1e-9) + 1)]


def fmt_tick(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e5 or abs(v) < 1e-3:
        return f"{v:.2e}".replace("e-0", "e-").replace("e+0", "e")
    return f"{v:.4g}"


def line_plot(series: Sequence[tuple[str, Sequence[float], Sequence[float]]], path: str, *,
              title: str = "", xlabel: str = "step", width: int = 900, height: int = 500) -> None:
    """Write a PNG line plot of ``(label, xs, ys)`` series to ``path``."""
    c = Canvas(width, height)
    left, right, top, bottom = 90, 20, 40, 50
    legend_rows = min(len(series), 8)
    top += legend_rows * 7 * SCALE
    pw, ph = width - left - right, height - top - bottom
    xs_all = [x for _, xs, ys in series for x, y in zip(xs, ys) if math.isfinite(y)]
    ys_all = [y for _, _, ys in series for y in ys if math.isfinite(y)]
    x0, x1 = (min(xs_all), max(xs_all)) if xs_all else (0.0, 1.0)
    y0, y1 = (min(ys_all), max(ys_all)) if ys_all else (0.0, 1.0)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        pad = abs(y0) * 0.05 or 1.0
        y0, y1 = y0 - pad, y1 + pad
    pad = (y1 - y0) * 0.05
    y0, y1 = y0 - pad, y1 + pad

    def X(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def Y(y: float) -> float:
        return top + ph - (y - y0) / (y1 - y0) * ph

    grey, axis = (225, 225, 225), (60, 60, 60)
    for t in nice_ticks(y0, y1):
        c.line(left, Y(t), left + pw, Y(t), grey)
        c.text(left - 8, int(Y(t)) - 5, fmt_tick(t), axis, anchor="right")
    for t in nice_ticks(x0, x1, 8):
        c.line(X(t), top, X(t), top + ph, grey)
        c.line(X(t), top + ph, X(t), top + ph + 5, axis)
        c.text(int(X(t)), top + ph + 10, fmt_tick(t), axis, anchor="center")
    c.rect(left, top, left, top + ph, axis)
    c.rect(left, top + ph, left + pw, top + ph, axis)
    for k, (label, xs, ys) in enumerate(series):
        color = PALETTE[k % len(PALETTE)]
        last: tuple[float, float] | None = None
        for x, y in zip(xs, ys):
            if not math.isfinite(y):
                last = None
                continue
            p = (X(x), Y(y))
            if last is not None:
                c.line(*last, *p, color, width=2)
            else:  # start of a segment (or a lone point)
                c.rect(int(p[0]) - 1, int(p[1]) - 1, int(p[0]) + 1, int(p[1]) + 1, color)
            last = p
        if k < legend_rows:
            ly = 40 + k * 7 * SCALE
            c.rect(left, ly + 2, left + 14, ly + 6, color)
            c.text(left + 22, ly, label if k < 7 or len(series) == 8 else f"... {len(series) - 7} more", axis)
    c.text(width // 2, 12, title, (0, 0, 0), anchor="center")
    c.text(left + pw // 2, height - 18, xlabel, axis, anchor="center")
    with open(path, "wb") as f:
        f.write(c.png())
