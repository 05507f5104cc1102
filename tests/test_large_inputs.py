"""Large buckets: the blockwise attention form (query chunks, online softmax over only the
key chunks of their segments) against transformers, its padding to whole chunks, the key
ranges it visits, and the artifact identity that records the form."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import compiled, rel_l2, run_graph
from emitter.builder import Builder
from emitter.config import PRESETS
from emitter.attention import BLOCKWISE_FROM, MAX_QUERY_CHUNKS, attention_chunk, attention_form, key_ranges
from emitter.vision import emit_vision_module, render_functions
from runtime.artifact.compiler import compile_mlir
from runtime.artifact.iree_module import LoadedModule

TOLERANCE = 1e-5
TINY = PRESETS["tiny"]


def transformers_outputs(cfg, grid_thw, seed):
    """transformers' merger and DeepStack outputs on random pixels for `grid_thw`."""
    from torch_reference import random_vision_state_dict, run_vision_tower
    rng = np.random.default_rng(seed)
    pixels = rng.uniform(-1, 1, (int(np.prod(grid_thw, axis=1).sum()), cfg.patch_dim)).astype(np.float32)
    weights = random_vision_state_dict(cfg, seed=seed)
    stages = run_vision_tower(cfg, weights, pixels, grid_thw)
    expected = {"image_embeds": stages["merger"]}
    for k in range(len(cfg.deepstack_visual_indexes)):
        expected[f"deepstack_features.{k}"] = stages[f"deepstack_merger_list.{k}"]
    return weights, pixels, expected


def assert_close(ours: dict, expected: dict) -> dict:
    errors = {name: rel_l2(ours[name], expected[name]) for name in expected}
    assert max(errors.values()) <= TOLERANCE, errors
    return errors


def test_large_buckets_take_the_blockwise_form():
    assert attention_form(BLOCKWISE_FROM - 4) == "dense" and attention_form(BLOCKWISE_FROM) == "blockwise"
    assert "stablehlo.while" not in emit_vision_module(TINY, BLOCKWISE_FROM - 4)
    assert "stablehlo.while" in emit_vision_module(TINY, BLOCKWISE_FROM)


def test_large_buckets_unroll_a_bounded_number_of_query_chunks():
    """Past 8192 patches the chunk grows so that a block unrolls at most MAX_QUERY_CHUNKS
    query chunks (the compile time of the 2B graph at 16384 with 32 a block was unbounded)."""
    assert [attention_chunk(n) for n in (512, 1000, 1024, 4096, 8192, 8200, 16384)] == [256, 256, 512, 512, 512, 1024,
                                                                                       1024]
    key_loops = emit_vision_module(TINY, 16384).count("stablehlo.while")
    assert key_loops == 1 + TINY.depth * MAX_QUERY_CHUNKS  # the key-range loop, then each chunk's key loop


@pytest.mark.slow  # about 15 s on a quiet machine, 50 s on a busy one
@pytest.mark.parity
def test_bucket_4096_with_several_images_matches_transformers():
    """Five images and a two-frame video, 3728 patches, in one blockwise call at bucket 4096
    (segments crossing chunk boundaries, padding its own segments)."""
    pytest.importorskip("transformers")
    grid_thw = np.array([[1, 32, 64], [1, 24, 40], [1, 16, 32], [2, 8, 8], [1, 4, 8], [1, 12, 4]], np.int64)
    weights, pixels, expected = transformers_outputs(TINY, grid_thw, seed=12)
    assert len(pixels) == 3728 and attention_form(4096) == "blockwise"
    ours = run_graph(compiled("tiny", 4096), TINY, weights, pixels, grid_thw, 4096)
    errors = assert_close(ours, expected)
    print(f"bucket 4096, {len(grid_thw)} inputs: relative L2 {max(errors.values()):.1e}")


@pytest.mark.parity
@pytest.mark.parametrize("grid_thw", [[[1, 16, 16], [1, 16, 16]], [[1, 16, 32]], [[1, 12, 20], [1, 8, 20], [1, 4, 4]]],
                         ids=["two images, a chunk each", "one image, both chunks", "three images across chunks"])
def test_bucket_512_takes_256_row_chunks_and_matches_transformers(grid_thw):
    """The default ladder's largest bucket: blockwise with 256-row chunks (two images of 256
    patches skip their cross blocks), exact whatever the segments' layout."""
    pytest.importorskip("transformers")
    grid_thw = np.array(grid_thw, np.int64)
    weights, pixels, expected = transformers_outputs(TINY, grid_thw, seed=5)
    assert attention_form(512) == "blockwise" and attention_chunk(512) == 256
    assert_close(run_graph(compiled("tiny", 512), TINY, weights, pixels, grid_thw, 512), expected)


@pytest.mark.parity
@pytest.mark.parametrize("bucket", [512, 1100])
def test_blockwise_form_in_bf16_stays_close_to_transformers(bucket):
    """The bf16 policy in the blockwise form (q, k, v chunked in bf16, padded with bf16 zeros
    at 1100, exp(scores - peak) rounded to bf16 once for the context and the denominator):
    clearly not f32, clearly the same function, as the dense form is at small buckets."""
    pytest.importorskip("transformers")
    from conftest import graph_weights
    from emitter.config import weight_schema
    from emitter.vision import result_names
    from runtime.checkpoints.vision import weights_in_order
    from runtime.inputs.packing import host_inputs
    grid_thw = np.array([[1, 12, 20], [1, 8, 20], [1, 4, 4]], np.int64)
    weights, pixels, expected = transformers_outputs(TINY, grid_thw, seed=5)
    flat = dict(zip([name for name, _ in weight_schema(TINY)], graph_weights(TINY, weights)))
    module = LoadedModule(compile_mlir(emit_vision_module(TINY, bucket, precision="bf16")))
    grids = [tuple(int(v) for v in g) for g in grid_thw]
    results = dict(zip(result_names(TINY), module(*host_inputs(pixels, grids, TINY, bucket),
                                                 *weights_in_order(flat, TINY, "bf16"))))
    merged = len(pixels) // TINY.merge_unit
    errors = {name: rel_l2(results[name][:merged], expected[name]) for name in expected}
    assert all(1e-5 < e < 2e-2 for e in errors.values()), errors


@pytest.mark.parity
def test_blockwise_form_pads_to_whole_chunks():
    """A bucket that is not a whole number of chunks (1100 rows, padded to 1536 inside the
    graph): same outputs as transformers."""
    pytest.importorskip("transformers")
    grid_thw = np.array([[1, 20, 24], [1, 16, 20], [1, 4, 4]], np.int64)
    weights, pixels, expected = transformers_outputs(TINY, grid_thw, seed=4)
    assert attention_form(1100) == "blockwise"
    assert_close(run_graph(compiled("tiny", 1100), TINY, weights, pixels, grid_thw, 1100), expected)


@pytest.mark.slow
@pytest.mark.parity
def test_bucket_past_8192_with_larger_chunks_matches_transformers():
    """Bucket 8200: 1024-row chunks (9 a block, padded to 9216), three images whose
    segments cross chunk boundaries."""
    pytest.importorskip("transformers")
    grid_thw = np.array([[1, 64, 64], [1, 56, 64], [1, 8, 12]], np.int64)
    weights, pixels, expected = transformers_outputs(TINY, grid_thw, seed=21)
    assert len(pixels) == 7776 and attention_chunk(8200) == 1024
    assert_close(run_graph(compiled("tiny", 8200), TINY, weights, pixels, grid_thw, 8200), expected)


def key_range_module(rows: int, chunk: int) -> LoadedModule:
    """Each query chunk's [first, end) key chunks for segment ids [rows], as the graph computes them."""
    b = Builder()
    ranges = key_ranges(b, b.argument("segments", (rows,), "i32"), chunk)
    results = [("first", ranges.first), ("end", ranges.end)]
    return LoadedModule(compile_mlir(render_functions([{"name": "main", "arguments": b.arguments,
                                                         "results": results, "body": b.lines}], b.globals)))


def test_each_query_chunk_visits_only_the_key_chunks_of_its_segments():
    """The cross-image blocks are skipped: for packed segments the key range of a query
    chunk is exactly the chunks its segments touch (numpy count), and for any ids it spans
    every key that shares a segment with it."""
    chunk, rows = 8, 64
    module = key_range_module(rows, chunk)
    rng = np.random.default_rng(0)
    packed = np.repeat(np.arange(5), [3, 20, 9, 17, 5]).astype(np.int32)
    layouts = [np.concatenate([packed, np.arange(5, 5 + rows - len(packed), dtype=np.int32)]),  # + padding ids
               rng.integers(0, 6, rows).astype(np.int32)]  # scattered: one wide span each
    for segments in layouts:
        first, end = module(segments)
        for i in range(rows // chunk):
            keys = np.flatnonzero(np.isin(segments, segments[i * chunk:(i + 1) * chunk]))
            assert (first[i], end[i]) == (keys[0] // chunk, keys[-1] // chunk + 1), (i, segments)
    first, end = module(layouts[0])
    visited = int((end - first).sum())
    assert visited < (rows // chunk) ** 2 // 2, "a packed call must skip most of the cross-segment blocks"


def test_attention_form_is_part_of_the_artifact_identity(monkeypatch):
    """The cache cannot hand a dense-form vmfb to a blockwise request: the graph hash differs."""
    import emitter.attention as attention
    from emitter.identity import vision_artifact_fields, artifact_identity
    from emitter.policy import DEFAULT_POLICY

    def identity():
        return artifact_identity(vision_artifact_fields(TINY, [64, BLOCKWISE_FROM], DEFAULT_POLICY,
                                                        compiler_version={}))

    blockwise = identity()
    monkeypatch.setattr(attention, "BLOCKWISE_FROM", 10 ** 9)
    assert attention_form(BLOCKWISE_FROM) == "dense"
    assert identity() != blockwise


def test_the_default_ladder_extends_by_powers_of_two():
    """An image past the default ladder's 512 patches gets the power of two that holds it,
    1024 at least; the ladder keeps its buckets; a fixed ladder grows the same way."""
    from emitter.identity import DEFAULT_LADDER, extended_bucket, ladder_for
    assert [extended_bucket(n) for n in (513, 1024, 1025, 4096, 8160, 16384)] == [1024, 1024, 2048, 4096, 8192,
                                                                                   16384]
    assert ladder_for([10, 512]) == DEFAULT_LADDER
    assert ladder_for([600, 4096, 8160, 100]) == (*DEFAULT_LADDER, 1024, 4096, 8192)
    assert ladder_for([200], (16, 32)) == (16, 32, 256)
    for n in (513, 3000, 16384, 65536):
        assert extended_bucket(n) >= n and extended_bucket(n) < 2 * n


@pytest.mark.parity
def test_large_images_run_at_the_defaults_and_match_transformers(tmp_path):
    """`qwen3vl run` without --bucket: a 720-patch image (past the default ladder) and a
    280-patch one, packed into a 1024 bucket compiled on first use, equal to transformers'
    tower on its own processor's pixels. A VisionSession without buckets grows the same way:
    the small image alone in the ladder, then both in 1024, the same bits as `run`."""
    import copy
    import json
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.numpy import load_file

    from conftest import rel_l2
    from helpers import write_images
    from runtime.checkpoints.synthetic import write_checkpoint
    from runtime.checkpoints.vision import load_vision_weights
    from runtime.vision import VisionSession
    pytest.importorskip("torch")
    processing = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    from torch_reference import hf_weight_shapes, run_vision_tower

    model, cache = tmp_path / "model", tmp_path / "cache"
    write_checkpoint(model, TINY, seed=5)
    images = write_images(tmp_path, [(480, 400), (64, 96)], seed=7)  # 24x30 = 720 patches; 20x14 (min_pixels)
    out = tmp_path / "f.safetensors"
    qwen3vl = Path(sys.executable).with_name("qwen3vl")
    result = subprocess.run([str(qwen3vl), "run", "--model", str(model), *images, "-o", str(out),
                             "--cache-dir", str(cache)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    assert "buckets  1024 (1000 patches, inputs [0, 1])" in result.stdout, result.stdout
    features = load_file(out)

    config = json.loads((model / "preprocessor_config.json").read_text())
    processed = processing.Qwen2VLImageProcessorPil(**copy.deepcopy(config))(images=images)
    shapes = dict(hf_weight_shapes(TINY))
    state = {name: w.reshape(shapes[name]) for name, w in load_vision_weights(model, TINY).items()}
    expected = run_vision_tower(TINY, state, np.asarray(processed["pixel_values"]),
                                np.asarray(processed["image_grid_thw"]))
    np.testing.assert_array_equal(features["grid_thw"], np.asarray(processed["image_grid_thw"]))
    assert rel_l2(features["image_embeds"], expected["merger"]) <= TOLERANCE
    for k in range(len(TINY.deepstack_visual_indexes)):
        assert rel_l2(features["deepstack_features"][k], expected[f"deepstack_merger_list.{k}"]) <= TOLERANCE

    session = VisionSession(model, cache_dir=cache)
    small = session.encode(images[1:])
    assert session.buckets == (64, 128, 256, 512) and [c.bucket for c in small.calls] == [512]
    both = session.encode(images)  # grows: the module of (64 ... 512, 1024), from the cache `run` filled
    assert session.buckets == (64, 128, 256, 512, 1024) and [c.bucket for c in both.calls] == [1024]
    np.testing.assert_array_equal(both.image_embeds, features["image_embeds"])
    np.testing.assert_array_equal(both.deepstack_features, features["deepstack_features"])
