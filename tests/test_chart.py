"""runtime/bench/chart.py: the hand-written SVG of the benchmarks' ratios parses as XML, its
bars are proportional to the ratios, the level line sits at 1, labels are escaped, and the
command line writes the same chart (or one error line)."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from runtime.bench.chart import Bar, parse_bar, ratio_chart

SVG = "{http://www.w3.org/2000/svg}"


def bars_of(svg: str):
    root = ET.fromstring(svg)
    return root, [(r.get("data-label"), float(r.get("data-ratio")), float(r.get("x")), float(r.get("width")))
                  for r in root.iter(SVG + "rect") if r.get("class") == "bar"]


def test_bars_are_proportional_to_the_ratios():
    bars = [Bar("prefill <q8_0> & co", 3.62), Bar("decode", 0.98, 0.95, 1.04), Bar("vision 1024 px", 2.1)]
    root, drawn = bars_of(ratio_chart(bars, "ours / llama.cpp", note="Zen 5, 2026-12-06"))
    assert [d[0] for d in drawn] == [b.label for b in bars]  # escaped in the file, the text back when parsed
    assert [d[1] for d in drawn] == [3.62, 0.98, 2.1]
    per_unit = [width / ratio for _, ratio, _, width in drawn]
    assert max(per_unit) - min(per_unit) < 0.01 and len({d[2] for d in drawn}) == 1  # one scale, one origin
    level = next(e for e in root.iter(SVG + "line") if e.get("class") == "level")
    assert abs(float(level.get("x1")) - (drawn[0][2] + per_unit[0])) < 0.2  # the line at 1
    assert root.find(SVG + "title").text == "ours / llama.cpp"
    assert len([e for e in root.iter(SVG + "path") if e.get("class") == "range"]) == 1
    assert float(root.get("width")) >= drawn[0][2] + drawn[0][3]  # the longest bar inside the picture


@pytest.mark.parametrize("bars, message", [([], "no ratio"), ([Bar("a", 0.0)], "a: ratio 0.0"),
                                            ([Bar("b", float("nan"))], "b: ratio nan"),
                                            ([Bar("c", 1.0, -1.0, 2.0)], "c: low -1.0")])
def test_bad_ratios_are_refused(bars, message):
    with pytest.raises(ValueError, match=message):
        ratio_chart(bars, "t")


def test_the_command_line(tmp_path):
    out = tmp_path / "c.svg"
    run = subprocess.run([sys.executable, "-m", "runtime.bench.chart", str(out), "--title", "t",
                          "--bar", "x=1.5", "--bar", "y=0.5:0.4-0.6"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert [d[1] for d in bars_of(out.read_text())[1]] == [1.5, 0.5]
    assert parse_bar("a=b=2") == Bar("a=b", 2.0)
    bad = subprocess.run([sys.executable, "-m", "runtime.bench.chart", str(out), "--title", "t", "--bar", "x"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: --bar 'x': expected LABEL=RATIO or LABEL=RATIO:LOW-HIGH"]
