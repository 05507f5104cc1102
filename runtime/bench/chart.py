"""Ratios as a bar chart in SVG, written by hand (no plotting library).

One horizontal bar per figure, its length proportional to the ratio (the axis starts at 0),
a dashed line at 1 (level), the per-round range as a whisker where there is one, and the
value beside each bar. A ratio is an "ours better by" figure (> 1: ours better; bars at or
past 1 are green, short of it orange), as the benchmarks print them. Used by `qwen3vl bench`
and benchmarks/bench_llamacpp.py (their --chart), and from the command line for charts of
figures already in the docs:

    .venv/bin/python -m runtime.bench.chart out.svg --title "..." --bar "prefill=3.62" --bar "decode=1.00:0.95-1.04"
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

ROW, BAR, PLOT, CHAR = 26, 16, 420, 7.2  # px: a row, a bar's thickness, the plot's width, a label character
STEPS = (0.1, 0.25, 0.5, 1, 2, 2.5, 5, 10, 20, 25, 50, 100)


@dataclass(frozen=True)
class Bar:
    label: str
    ratio: float
    low: float | None = None   # the per-round range, when there is one
    high: float | None = None


def ratio_chart(bars: list[Bar], title: str, note: str = "") -> str:
    """The SVG document of `bars` (ValueError for no bar or a ratio that is not a positive number)."""
    if not bars:
        raise ValueError(f"chart {title!r}: no ratio to draw")
    for b in bars:
        for name, value in (("ratio", b.ratio), ("low", b.low), ("high", b.high)):
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"chart {title!r}, {b.label}: {name} {value!r}: expected a positive number")
    top = max([1.0] + [max(b.ratio, b.high or 0) for b in bars])
    step = next((s for s in STEPS if top / s <= 6), STEPS[-1])
    end = step * math.ceil(top * 1.08 / step)
    scale = PLOT / end
    left = 12 + CHAR * max(len(b.label) for b in bars)
    head, width = 34, left + PLOT + 70
    height = head + ROW * len(bars) + 34 + (18 if note else 0)
    x = lambda v: left + v * scale  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height}" '
           f'viewBox="0 0 {width:.0f} {height}" font-family="sans-serif" font-size="12">',
           f"<title>{escape(title)}</title>",
           '<rect width="100%" height="100%" fill="#fff"/>',
           f'<text x="8" y="20" font-size="14" font-weight="bold">{escape(title)}</text>']
    axis = head + ROW * len(bars)
    for i in range(int(round(end / step)) + 1):
        v = i * step
        out.append(f'<line x1="{x(v):.1f}" y1="{head - 4}" x2="{x(v):.1f}" y2="{axis}" stroke="#e4e4e4"/>')
        out.append(f'<text x="{x(v):.1f}" y="{axis + 14}" text-anchor="middle" fill="#555">{v:g}</text>')
    for n, b in enumerate(bars):
        y = head + n * ROW
        color = "#2e8b57" if b.ratio >= 1 else "#e07b00"
        out.append(f'<text x="{left - 8:.1f}" y="{y + BAR - 4}" text-anchor="end">{escape(b.label)}</text>')
        out.append(f'<rect class="bar" data-ratio="{b.ratio:g}" data-label={quoteattr(b.label)} x="{left:.1f}" '
                   f'y="{y}" width="{b.ratio * scale:.2f}" height="{BAR}" fill="{color}"/>')
        if b.low is not None and b.high is not None:
            mid = y + BAR / 2
            out.append(f'<path class="range" d="M{x(b.low):.1f} {mid}H{x(b.high):.1f}M{x(b.low):.1f} {mid - 4}'
                       f'V{mid + 4}M{x(b.high):.1f} {mid - 4}V{mid + 4}" stroke="#222" fill="none"/>')
        value = f"x{b.ratio:.2f}" + (f" ({b.low:.2f}-{b.high:.2f})" if b.low is not None and b.high is not None else "")
        out.append(f'<text x="{x(max(b.ratio, b.high or 0)) + 5:.1f}" y="{y + BAR - 4}">{escape(value)}</text>')
    out.append(f'<line class="level" x1="{x(1):.1f}" y1="{head - 8}" x2="{x(1):.1f}" y2="{axis}" stroke="#222" '
               'stroke-dasharray="4 3"/>')
    out.append(f'<text x="{left:.1f}" y="{axis + 30}" fill="#555">ours better by (1 = level; longer is better)</text>')
    if note:
        out.append(f'<text x="8" y="{axis + 48}" fill="#555" font-size="11">{escape(note)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_chart(path, bars: list[Bar], title: str, note: str = "") -> Path:
    """`ratio_chart` written to `path` (atomically: a temporary file, then renamed)."""
    path = Path(path)
    text = ratio_chart(bars, title, note)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def parse_bar(text: str) -> Bar:
    """LABEL=RATIO or LABEL=RATIO:LOW-HIGH (ValueError naming the text otherwise)."""
    label, sep, value = text.rpartition("=")
    try:
        ratio, _, spread = value.partition(":")
        low, high = (float(v) for v in spread.split("-")) if spread else (None, None)
        if not sep or not label:
            raise ValueError
        return Bar(label, float(ratio), low, high)
    except ValueError:
        raise ValueError(f"--bar {text!r}: expected LABEL=RATIO or LABEL=RATIO:LOW-HIGH") from None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Write a bar chart of ratios as SVG (runtime/bench/chart.py).")
    p.add_argument("out", type=Path, help="the .svg file")
    p.add_argument("--title", required=True)
    p.add_argument("--note", default="", help="a line under the chart (where the figures come from)")
    p.add_argument("--bar", action="append", required=True, metavar="LABEL=RATIO[:LOW-HIGH]")
    args = p.parse_args(argv)
    try:
        write_chart(args.out, [parse_bar(b) for b in args.bar], args.title, args.note)
    except (ValueError, OSError) as e:
        p.exit(2, f"error: {e}\n")
    print(args.out)


if __name__ == "__main__":
    main()
