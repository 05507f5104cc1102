"""`qwen3vl bench` runs and writes its figures (no timing is asserted: the machines are
noisy, and performance is measured by the benchmark itself, not by tests)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from emitter.precision import precision

QWEN3VL = str(Path(sys.executable).parent / "qwen3vl")
TINY = ["--preset", "tiny", "--bucket", "512", "--images", "64x64,64x64", "--repeats", "1", "--warmup", "0",
        "--roof-sizes", "128"]
ISSUE_KEYS = ("ours_s", "torch_s", "ratio", "gflops", "roof_gflops", "roof_fraction", "ours_bf16_s", "torch_bf16_s",
              "ratio_bf16", "roof_bf16_gflops", "roof_bf16_fraction")
# Run the CLI with torch unimportable, as on an installed package without it.
WITHOUT_TORCH = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
                 "from runtime.commands.main import main; main()")


def test_bench_both_precisions_and_end_to_end(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([QWEN3VL, "bench", *TINY, "--precision", "both", "--end-to-end", "--json", str(out)],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    f = json.loads(out.read_text())
    for key in ISSUE_KEYS + ("gflops_bf16", "e2e_s", "e2e_overhead", "emit_s", "compile_s", "peak_rss_bytes"):
        assert key in f, key
    assert f["ours_s"] > 0 and f["ours_bf16_s"] > 0 and f["gflops"] > 0
    assert f["ours_min_s"] <= f["ours_s"] <= f["ours_max_s"]
    assert f["roof_gflops"] == max(f["roof"]["f32"]["all"].values()) > 0
    assert {"numpy 128", "iree 128"} <= set(f["roof"]["f32"]["all"]) and "iree 128" in f["roof"]["bf16"]["all"]
    assert f["roof_fraction"] == f["gflops"] / f["roof_gflops"]
    assert f["rel_l2_e2e_vs_graph"] <= 1e-6  # the session on image files computes the same embeddings
    assert f["graph_precisions"] == {"f32": "f32", "bf16": precision("bf16").for_target().name}  # as the commands build it
    if importlib.util.find_spec("transformers") is not None:  # ours agrees with transformers' sdpa tower
        assert "sdpa" in f["torch"], f["torch"]
        assert f["torch_s"] > 0 and f["torch_bf16_s"] > 0 and f["ratio"] == f["torch_s"] / f["ours_s"]
        assert f["rel_l2_vs_torch"] <= 1e-5
        assert f["rel_l2_bf16_vs_torch_f32"] <= 3e-2
        assert "torch 128" in f["roof"]["bf16"]["all"]
        chart = ET.parse(out.with_suffix(".svg")).getroot()  # --json's neighbour: the ratios as bars
        bars = [float(r.get("data-ratio")) for r in chart.iter("{http://www.w3.org/2000/svg}rect")
                if r.get("class") == "bar"]
        assert bars == [float(f"{f['ratio']:g}"), float(f"{f['ratio_bf16']:g}")], bars


def test_bench_without_torch_times_ours_against_the_roof(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, "bench", *TINY, "--json", str(out)],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "torch is not installed" in result.stdout
    f = json.loads(out.read_text())
    assert f["torch"] == "torch is not installed" and f["torch_s"] is None and f["ratio"] is None
    assert "chart: not written (no ratio: transformers did not run: torch is not installed)" in result.stdout
    assert not out.with_suffix(".svg").exists()
    assert f["ours_s"] > 0 and f["roof_gflops"] > 0 and f["roof_fraction"] > 0
    assert not any(name.startswith("torch") for name in f["roof"]["f32"]["all"])
    # An f32 bench times no bf16 matmul (on a CPU without a bf16 dot product they were scalar).
    assert f["ours_bf16_s"] is None and f["roof_bf16_gflops"] is None and list(f["roof"]) == ["f32"]


def test_bench_bad_input_is_one_line(tmp_path):
    out = tmp_path / "bench.json"
    for args, expected in ((["--images", "64by64"], "--images 64by64: expected comma-separated WxH"),
                           (["--bucket", "64"], "--bucket 64: the images of --images"),
                           (["--roof-sizes", "big"], "--roof-sizes big: expected")):
        result = subprocess.run([QWEN3VL, "bench", *TINY, *args, "--json", str(out)], capture_output=True, text=True)
        assert result.returncode != 0
        assert result.stderr.strip().splitlines() == [f"error: {result.stderr.strip()[7:]}"]
        assert expected in result.stderr, result.stderr
        assert not out.exists()
