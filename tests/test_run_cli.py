"""`qwen3vl run` end to end: checkpoints in both layouts against transformers'
processor + vision tower, the features file, and one-line errors for bad input."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import rel_l2
from helpers import write_images
from emitter.config import PRESETS
from runtime.checkpoints.vision import load_vision_weights
from runtime.checkpoints.synthetic import DEFAULT_PROCESSOR, write_checkpoint

QWEN3VL = str(Path(sys.executable).parent / "qwen3vl")
TINY = PRESETS["tiny"]
SMALL_POLICY = dict(DEFAULT_PROCESSOR, size={"shortest_edge": 4096, "longest_edge": 32768})
SIZES = [(96, 64), (200, 90), (64, 64), (130, 170), (40, 250)]  # (w, h); more than one 128 bucket


def qwen3vl(*args):
    return subprocess.run([QWEN3VL, *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def run_model(model, images, out, cache_dir):
    result = qwen3vl("run", "--model", str(model), *images, "-o", str(out), "--bucket", "64", "--bucket", "128",
                     "--cache-dir", cache_dir)
    assert result.returncode == 0, result.stderr
    return load_file(out), result.stdout


def test_run_writes_features_and_summary(tmp_path, cache_dir):
    write_checkpoint(tmp_path / "m", TINY, seed=1, processor_policy_dict=SMALL_POLICY)
    images = write_images(tmp_path, SIZES)
    features, summary = run_model(tmp_path / "m", images, tmp_path / "f.safetensors", cache_dir)
    merged = [int(np.prod(g)) // 4 for g in features["grid_thw"]]
    assert features["grid_thw"].dtype == np.int64 and features["grid_thw"].shape == (len(images), 3)
    assert features["image_embeds"].shape == (sum(merged), TINY.out_hidden_size)
    assert features["deepstack_features"].shape == (2, sum(merged), TINY.out_hidden_size)
    assert features["image_embeds"].dtype == np.float32
    for word in ("image", "buckets", "load", "process", "run"):
        assert word in summary


LAYOUTS = {  # name -> write_checkpoint options
    "hf-f32": dict(layout="hf", dtype="f32"),
    "hf-bf16-sharded": dict(layout="hf", dtype="bf16", shards=3),
    "mlx-4bit": dict(layout="mlx", dtype="bf16", bits=4, group_size=32),
    "mlx-8bit": dict(layout="mlx", dtype="f16", bits=8, group_size=64),
}


@pytest.mark.parity
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_run_matches_transformers(tmp_path, cache_dir, layout):
    pytest.importorskip("torch")
    processing = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    from torch_reference import hf_weight_shapes, run_vision_tower

    model = tmp_path / "model"
    write_checkpoint(model, TINY, seed=4, processor_policy_dict=SMALL_POLICY, **LAYOUTS[layout])
    images = write_images(tmp_path, SIZES, seed=sum(map(ord, layout)))
    features, _ = run_model(model, images, tmp_path / "f.safetensors", cache_dir)

    # transformers: its own processor on the same files, its tower on the dequantized weights
    config = json.loads((model / "preprocessor_config.json").read_text())
    processed = processing.Qwen2VLImageProcessorPil(**copy.deepcopy(config))(images=images)
    weights = load_vision_weights(model, TINY)
    shapes = dict(hf_weight_shapes(TINY))
    state = {name: w.reshape(shapes[name]) for name, w in weights.items()}
    expected = run_vision_tower(TINY, state, np.asarray(processed["pixel_values"]),
                                np.asarray(processed["image_grid_thw"]))
    np.testing.assert_array_equal(features["grid_thw"], np.asarray(processed["image_grid_thw"]))
    assert rel_l2(features["image_embeds"], expected["merger"]) <= 1e-5
    for k in range(len(TINY.deepstack_visual_indexes)):
        assert rel_l2(features["deepstack_features"][k], expected[f"deepstack_merger_list.{k}"]) <= 1e-5


def bad_cases(tmp_path):
    good = tmp_path / "good"
    write_checkpoint(good, TINY, seed=1, processor_policy_dict=SMALL_POLICY)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((good / "config.json").read_text())
    (empty / "preprocessor_config.json").write_text((good / "preprocessor_config.json").read_text())
    not_image = tmp_path / "notes.png"
    not_image.write_text("not a png")
    (image,) = write_images(tmp_path, sizes=[(64, 64)])
    return {
        "missing image": ([str(good), str(tmp_path / "nope.png")], "nope.png"),
        "not an image": ([str(good), str(not_image)], "notes.png"),
        "no vision weights": ([str(empty), image], "empty"),
        "missing model folder": ([str(tmp_path / "absent"), image], "absent"),
    }


@pytest.mark.parametrize("case", ["missing image", "not an image", "no vision weights", "missing model folder"])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, cache_dir, case):
    (model, image), named = bad_cases(tmp_path)[case]
    out = tmp_path / "out.safetensors"
    result = qwen3vl("run", "--model", model, image, "-o", str(out), "--bucket", "64", "--cache-dir", cache_dir)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], result.stderr
    assert not out.exists() and not list(tmp_path.glob(".out.safetensors*"))


def test_output_into_missing_folder_is_refused(tmp_path, cache_dir):
    write_checkpoint(tmp_path / "m", TINY, seed=1, processor_policy_dict=SMALL_POLICY)
    images = write_images(tmp_path, sizes=[(64, 64)])
    result = qwen3vl("run", "--model", str(tmp_path / "m"), *images, "-o", str(tmp_path / "no" / "f.safetensors"),
                     "--cache-dir", cache_dir)
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_a_compile_failure_is_one_line(tmp_path, monkeypatch):
    """The emitter writes an op iree-compile does not know: a real compile failure, said in
    one line (the compiler's first error), status 1, no output file."""
    from click.testing import CliRunner
    import emitter.layers as layers
    from runtime.commands.main import main
    monkeypatch.setattr(layers, "gelu_erf", lambda b, x: b._unary("stablehlo.no_such_op", x, "bogus"))
    write_checkpoint(tmp_path / "m", TINY, seed=1, processor_policy_dict=SMALL_POLICY)
    images = write_images(tmp_path, SIZES[:1])
    out = tmp_path / "f.safetensors"
    result = CliRunner().invoke(main, ["run", "--model", str(tmp_path / "m"), *images, "-o", str(out), "--bucket",
                                       "64", "--cache-dir", str(tmp_path / "cache")], catch_exceptions=False)
    assert result.exit_code == 1, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: iree-compile failed for target llvm-cpu"), errors
    assert "no_such_op" in errors[0] and result.stderr.splitlines()[-1] == errors[0]
    assert "Traceback" not in result.output and not out.exists()
