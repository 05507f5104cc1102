"""`emit-qwen3vl` as a user runs it: output, files, and one-line errors for bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from emitter.config import PRESETS
from emitter.vision import emit_vision_module
from runtime.artifact.compiler import compile_mlir

BIN = Path(sys.executable).parent
EMIT = str(BIN / "emit-qwen3vl")


def run(*args, cwd=None):
    return subprocess.run([EMIT, *args], capture_output=True, text=True, cwd=cwd)


def iree_opt_accepts(path: Path) -> None:
    result = subprocess.run([str(BIN / "iree-opt"), str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[:2000]


def test_default_is_2b_at_bucket_512_and_iree_opt_accepts_it(tmp_path):
    result = run("--bucket", "512")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "bucket 512 patches" in text and "hidden_size=1024" in text and "deepstack_visual_indexes=[5, 11, 17]" in text
    assert text == emit_vision_module(PRESETS["qwen3-vl-2b"], 512, title="preset qwen3-vl-2b")
    path = tmp_path / "2b.mlir"
    path.write_text(text)
    iree_opt_accepts(path)


def test_output_file_and_diagnostics(tmp_path):
    out = tmp_path / "tiny.mlir"
    result = run("--bucket", "32", "--preset", "tiny", "--diagnostics", "--inspect-block", "1", "-o", str(out))
    assert result.returncode == 0 and result.stdout == ""
    text = out.read_text()
    assert '"stage.blocks.1.norm1"' in text and '"stage.blocks.0.norm1"' not in text
    iree_opt_accepts(out)
    assert list(tmp_path.iterdir()) == [out]  # no temp files left


def test_model_folder_config(tmp_path):
    from helpers import write_config
    write_config(tmp_path, PRESETS["tiny"])
    result = run("--bucket", "16", "--model", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "hidden_size=64" in result.stdout


@pytest.mark.parametrize("bucket", [4, 16, 64])
def test_tiny_compiles_at_several_buckets(bucket):
    vmfb = compile_mlir(emit_vision_module(PRESETS["tiny"], bucket))
    assert len(vmfb) > 1000


def test_emission_is_deterministic():
    cfg = PRESETS["qwen3-vl-8b"]
    assert emit_vision_module(cfg, 64, diagnostics=True) == emit_vision_module(cfg, 64, diagnostics=True)


def bad_config(tmp_path, mutate):
    from helpers import write_config
    write_config(tmp_path, PRESETS["tiny"], mutate=mutate)
    return ["--bucket", "16", "--model", str(tmp_path)]


BAD_INPUTS = {
    "bucket 0": (lambda p: ["--bucket", "0"], "--bucket 0"),
    "bucket 6": (lambda p: ["--bucket", "6"], "--bucket 6"),
    "bucket -4": (lambda p: ["--bucket", "-4"], "--bucket -4"),
    "bucket abc": (lambda p: ["--bucket", "abc"], "--bucket 'abc'"),
    "unknown preset": (lambda p: ["--bucket", "16", "--preset", "nope"], "--preset 'nope'"),
    "missing folder": (lambda p: ["--bucket", "16", "--model", str(p / "absent")], "absent"),
    "no config.json": (lambda p: ["--bucket", "16", "--model", str(p)], "config.json"),
    "missing field": (lambda p: bad_config(p, lambda v: v.pop("depth")), "vision_config.depth"),
    "head_dim % 4": (lambda p: bad_config(p, lambda v: v.update(num_heads=32)), "num_heads"),
    "non-square table": (lambda p: bad_config(p, lambda v: v.update(num_position_embeddings=2300)),
                         "num_position_embeddings"),
    "deepstack out of range": (lambda p: bad_config(p, lambda v: v.update(deepstack_visual_indexes=[1, 4])),
                               "deepstack_visual_indexes"),
    "deepstack unordered": (lambda p: bad_config(p, lambda v: v.update(deepstack_visual_indexes=[2, 1])),
                            "deepstack_visual_indexes"),
    "merge size 3": (lambda p: bad_config(p, lambda v: v.update(spatial_merge_size=3)), "spatial_merge_size"),
    "depth 1e9 (no checkpoint to compare)": (lambda p: bad_config(p, lambda v: v.update(depth=1_000_000_000)),
                                             "depth' = 1000000000: expected at most 1024"),
    "weights beyond 1 TiB": (lambda p: bad_config(p, lambda v: v.update(depth=1000, hidden_size=16384,
                                                                         num_heads=128, intermediate_size=65536)),
                             "GiB of f32 vision weights"),
    "inspect block out of range": (lambda p: ["--bucket", "16", "--preset", "tiny", "--diagnostics",
                                              "--inspect-block", "9"], "--inspect-block 9"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, case):
    make_args, named = BAD_INPUTS[case]
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "out.mlir"
    result = run(*make_args(work), "-o", str(out))
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.mlir")]
