"""Large inputs and any size: the blockwise attention form (a loop over query chunks, an
online softmax over only the key chunks of their segments) against transformers, the rows
as a run-time count padded to whole chunks, the key ranges it visits, the graph the same
size for every bucket, and the default buckets taking any image with one compile."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import compiled, rel_l2, run_graph
from emitter.builder import Builder
from emitter.config import PRESETS
from emitter.attention import BLOCKWISE_FROM, attention_chunk, attention_form, key_ranges
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
    assert "scf.for" not in emit_vision_module(TINY, BLOCKWISE_FROM - 4)
    assert "scf.for" in emit_vision_module(TINY, BLOCKWISE_FROM)


def test_the_graph_is_the_same_size_for_any_bucket():
    """Query and key chunks are loops in the graph and the rows a run-time count: the graph of
    every blockwise bucket holds the same ops (one key-range loop, then per block a loop over
    query chunks around a loop over key chunks); only the chunk (256 below 1024 patches,
    512 from there) and the header differ."""
    assert [attention_chunk(n) for n in (512, 1000, 1024, 4096, 8192, 16384, 65536)] == [256, 256, 512, 512, 512,
                                                                                       512, 512]
    graphs = {n: emit_vision_module(TINY, n) for n in (512, 1024, 8192, 65536)}
    for text in graphs.values():
        assert text.count("scf.for") == 1 + TINY.depth and text.count("stablehlo.while") == TINY.depth
    sizes = [len(text) for text in graphs.values()]
    assert max(sizes) <= 1.01 * min(sizes), sizes
    body = {n: text.split("\n", 1)[1] for n, text in graphs.items()}
    assert body[1024] == body[8192] == body[65536]


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
    """The bf16 policy in the blockwise form (q, k, v chunked in bf16, exp(scores - peak)
    rounded to bf16 once for the context and the denominator):
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
    """816 patches in bucket 1100: the host pads them to 1024 rows, two 512-row chunks, not to
    the bucket: same outputs as transformers."""
    pytest.importorskip("transformers")
    from runtime.inputs.packing import host_inputs
    grid_thw = np.array([[1, 20, 24], [1, 16, 20], [1, 4, 4]], np.int64)
    weights, pixels, expected = transformers_outputs(TINY, grid_thw, seed=4)
    assert attention_form(1100) == "blockwise"
    assert len(host_inputs(pixels, [tuple(g) for g in grid_thw], TINY, 1100)[0]) == 1024
    assert_close(run_graph(compiled("tiny", 1100), TINY, weights, pixels, grid_thw, 1100), expected)


@pytest.mark.slow
@pytest.mark.parity
def test_bucket_past_8192_matches_transformers():
    """Bucket 8200: 7776 patches in 16 chunks of 512 rows (8192), three images whose segments
    cross chunk boundaries."""
    pytest.importorskip("transformers")
    grid_thw = np.array([[1, 64, 64], [1, 56, 64], [1, 8, 12]], np.int64)
    weights, pixels, expected = transformers_outputs(TINY, grid_thw, seed=21)
    assert len(pixels) == 7776 and attention_chunk(8200) == 512
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


def test_an_image_past_the_largest_default_bucket_is_a_call_of_its_own():
    """Default buckets (open top): images pack up to the largest bucket, and a larger image is
    a call of its own to it; fixed buckets refuse it."""
    from emitter.identity import DEFAULT_LADDER
    from runtime.inputs.packing import PackingError, pack
    small, top = DEFAULT_LADDER[0], DEFAULT_LADDER[-1]
    grids = [(1, 16, 16), (1, 16, 16), (1, 128, 160), (1, 8, 8)]  # 256, 256, 20480, 64 patches
    calls = pack(grids, DEFAULT_LADDER, open_top=True)
    assert [(c.bucket, c.images, c.patches) for c in calls] == [(small, (0, 1), 512), (top, (2,), 20480),
                                                                (small, (3,), 64)]
    with pytest.raises(PackingError, match="fit no bucket"):
        pack(grids, DEFAULT_LADDER)


@pytest.mark.parity
def test_any_image_size_runs_at_the_defaults_with_one_compile(tmp_path):
    """`qwen3vl run` without --bucket: a 1000x700 photo (a size no bucket was ever made for),
    a 720-patch image and a 280-patch one, in the 16384 entry, equal to transformers' tower on
    its own processor's pixels. Then a VisionSession over the same cache encodes other sizes,
    small and large, with no compile: the cache holds the one module `run` built, and the
    same images give the same bits."""
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
    images = write_images(tmp_path, [(1000, 700), (480, 400), (64, 96)], seed=7)
    out = tmp_path / "f.safetensors"
    qwen3vl = Path(sys.executable).with_name("qwen3vl")
    result = subprocess.run([str(qwen3vl), "run", "--model", str(model), *images, "-o", str(out),
                             "--cache-dir", str(cache)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    assert "compiling the vision tower for this checkpoint (once, about" in result.stderr, result.stderr
    config = json.loads((model / "preprocessor_config.json").read_text())
    processed = processing.Qwen2VLImageProcessorPil(**copy.deepcopy(config))(images=images)
    patches = int(np.prod(processed["image_grid_thw"], axis=1).sum())
    assert f"buckets  16384 ({patches} patches, inputs [0, 1, 2])" in result.stdout, result.stdout
    features = load_file(out)

    shapes = dict(hf_weight_shapes(TINY))
    state = {name: w.reshape(shapes[name]) for name, w in load_vision_weights(model, TINY).items()}
    expected = run_vision_tower(TINY, state, np.asarray(processed["pixel_values"]),
                                np.asarray(processed["image_grid_thw"]))
    np.testing.assert_array_equal(features["grid_thw"], np.asarray(processed["image_grid_thw"]))
    assert rel_l2(features["image_embeds"], expected["merger"]) <= TOLERANCE
    for k in range(len(TINY.deepstack_visual_indexes)):
        assert rel_l2(features["deepstack_features"][k], expected[f"deepstack_merger_list.{k}"]) <= TOLERANCE

    built = sorted(p.name for p in cache.rglob("*.vmfb"))
    assert len(built) == 1
    heard = []
    session = VisionSession(model, cache_dir=cache, progress=heard.append)
    more = write_images(tmp_path, [(300, 200), (1300, 900), (2000, 1100)], seed=8, stem="more")
    for group in ([more[0]], [more[1]], more, images[2:]):
        session.encode(group)
    assert not [line for line in heard if "compiling" in line], heard
    assert sorted(p.name for p in cache.rglob("*.vmfb")) == built, "a new size compiled a module"
    again = session.encode(images)
    assert [c.bucket for c in again.calls] == [16384]
    np.testing.assert_array_equal(again.image_embeds, features["image_embeds"])
    np.testing.assert_array_equal(again.deepstack_features, features["deepstack_features"])
