"""Golden MLIR: the emitter must reproduce the files in golden/ byte for byte.

After an intended change, rewrite them with `make golden` (runs this file as a script)."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

import pytest

from emitter.config import PRESETS
from emitter.identity import DEFAULT_LADDER
from emitter.vision import emit_artifact_module, emit_vision_module

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
CASES = {  # file name -> (preset, buckets, diagnostics); several buckets: the artifact module
    "tiny_b16.mlir": ("tiny", (16,), False),  # the dense attention form, run-time rows
    "tiny_b16_diagnostics.mlir": ("tiny", (16,), True),
    "tiny_b512.mlir": ("tiny", (512,), False),  # blockwise: loops over query and key chunks
    "tiny_artifact_default.mlir": ("tiny", DEFAULT_LADDER, False),  # what a session compiles
}


def emit_case(name: str) -> str:
    preset, buckets, diagnostics = CASES[name]
    if len(buckets) == 1:  # emit-qwen3vl's single function, weights as arguments
        return emit_vision_module(PRESETS[preset], buckets[0], diagnostics=diagnostics, title=f"preset {preset}")
    return emit_artifact_module(PRESETS[preset], buckets, diagnostics=diagnostics, title=f"preset {preset}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_emitter_reproduces_golden(name):
    path = GOLDEN / name
    expected, actual = path.read_text(), emit_case(name)
    if actual != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True),
                                            fromfile=str(path), tofile="emitted", n=2))
        pytest.fail(f"emitted MLIR differs from golden file {path} (run `make golden` if intended):\n"
                    + diff[:20000], pytrace=False)


def test_golden_files_are_all_cases():
    assert sorted(p.name for p in GOLDEN.glob("*.mlir")) == sorted(CASES)


if __name__ == "__main__":
    for case in sorted(CASES):
        (GOLDEN / case).write_text(emit_case(case))
        print(f"wrote {GOLDEN / case}", file=sys.stderr)
