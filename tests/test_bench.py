"""`qwen3vl bench` runs and writes its figures (no timing is asserted: the machines are
noisy, and performance is measured by the benchmark itself, not by tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

QWEN3VL = str(Path(sys.executable).parent / "qwen3vl")


def test_bench_writes_its_figures(tmp_path):
    from runtime.synthetic import write_checkpoint
    from emitter.config import PRESETS
    write_checkpoint(tmp_path / "m", PRESETS["tiny"], seed=0)
    out = tmp_path / "bench.json"
    result = subprocess.run([QWEN3VL, "bench", "--model", str(tmp_path / "m"), "--bucket", "256", "--images", "64x64",
                             "--repeats", "1", "--warmup", "0", "--json", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    figures = json.loads(out.read_text())
    for key in ("ours_s", "torch_s", "ratio", "gflops", "ceiling_gflops", "emit_s", "compile_s", "vmfb_bytes",
                "peak_rss_bytes"):
        assert key in figures
    assert figures["ours_s"] > 0 and figures["gflops"] > 0
    if figures["torch_s"] is not None:  # transformers installed: ours agrees with it
        assert figures["rel_l2_vs_torch"] <= 1e-5
