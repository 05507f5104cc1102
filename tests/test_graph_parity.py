"""The compiled graph against transformers' vision tower: committed fixtures (always run)
and a live comparison (when torch and transformers are importable)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import compiled, rel_l2, run_graph
from emitter.config import PRESETS

TOLERANCE = 1e-5  # relative L2, every output and every stage
TINY = PRESETS["tiny"]
ALL_BLOCKS = tuple(range(TINY.depth))


def compare_all(ours: dict, reference: dict) -> dict[str, float]:
    errors = {name: rel_l2(ours[name], reference[name]) for name in reference}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, f"stage {worst}: relative L2 {errors[worst]:.3g} > {TOLERANCE}"
    return errors


@pytest.mark.parametrize("bucket", [120, 128])
def test_outputs_and_every_stage_match_fixture(tiny_parity, bucket):
    weights, pixels, grid_thw, stages = tiny_parity
    module = compiled("tiny", bucket, True, ALL_BLOCKS)
    ours = run_graph(module, TINY, weights, pixels, grid_thw, bucket, diagnostics=True, inspect=ALL_BLOCKS)
    reference = {f"stage.{k}": v for k, v in stages.items()}
    reference["image_embeds"] = stages["merger"]
    for k in range(len(TINY.deepstack_visual_indexes)):
        reference[f"deepstack_features.{k}"] = stages[f"deepstack_merger_list.{k}"]
    assert set(reference) <= set(ours)
    compare_all(ours, reference)


def test_plain_variant_matches_fixture_and_padding_is_finite(tiny_parity):
    weights, pixels, grid_thw, stages = tiny_parity
    bucket = 256
    module = compiled("tiny", bucket)
    from runtime.inputs.packing import host_inputs
    from conftest import graph_weights
    raw = module(*host_inputs(pixels, [tuple(g) for g in grid_thw], TINY, bucket), *graph_weights(TINY, weights))
    assert all(np.isfinite(r).all() for r in raw), "padding rows must stay finite"
    ours = run_graph(module, TINY, weights, pixels, grid_thw, bucket)
    compare_all(ours, {"image_embeds": stages["merger"], "deepstack_features.0": stages["deepstack_merger_list.0"],
                       "deepstack_features.1": stages["deepstack_merger_list.1"]})


def test_images_do_not_see_each_other(tiny_parity):
    """Packing a second image beside the first leaves the first image's outputs unchanged."""
    weights, pixels, grid_thw, stages = tiny_parity
    first = int(np.prod(grid_thw[0]))
    module = compiled("tiny", 128)
    alone = run_graph(module, TINY, weights, pixels[:first], grid_thw[:1], 128)
    packed = run_graph(module, TINY, weights, pixels, grid_thw, 128)
    merged = first // TINY.merge_unit
    np.testing.assert_allclose(alone["image_embeds"], packed["image_embeds"][:merged], rtol=1e-5, atol=1e-6)


@pytest.mark.parity
def test_live_parity_with_transformers():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from torch_reference import random_vision_state_dict, run_vision_tower

    rng = np.random.default_rng(7)
    grid_thw = np.array([[1, 6, 10], [1, 12, 4], [2, 2, 4]], dtype=np.int64)
    n = int(np.prod(grid_thw, axis=1).sum())
    pixels = rng.uniform(-1, 1, (n, TINY.patch_dim)).astype(np.float32)
    weights = random_vision_state_dict(TINY, seed=3)
    expected = run_vision_tower(TINY, weights, pixels, grid_thw)
    module = compiled("tiny", 128, True, ALL_BLOCKS)
    ours = run_graph(module, TINY, weights, pixels, grid_thw, 128, diagnostics=True, inspect=ALL_BLOCKS)
    compare_all(ours, {f"stage.{k}": v for k, v in expected.items()})


def test_parameter_bound_weights_match_fixture(tiny_parity):
    """The same graph with its weights read from a parameter archive instead of arguments."""
    import iree.runtime as rt
    from conftest import graph_weights
    from emitter.vision import graph_weights as weight_specs
    from emitter.vision import emit_vision_module, result_names
    from runtime.artifact.compiler import compile_mlir
    from runtime.artifact.iree_module import LoadedModule, parameters_module
    from runtime.inputs.packing import host_inputs

    weights, pixels, grid_thw, stages = tiny_parity
    config = rt.Config("local-task")
    named = [(w.name, a) for w, a in zip(weight_specs(TINY), graph_weights(TINY, weights))]
    module = LoadedModule(compile_mlir(emit_vision_module(TINY, 128, weights="parameters")), config=config,
                          modules=[parameters_module(config, named)])
    results = dict(zip(result_names(TINY), module(*host_inputs(pixels, [tuple(g) for g in grid_thw], TINY, 128))))
    merged = len(pixels) // TINY.merge_unit
    compare_all({k: v[:merged] for k, v in results.items()},
                {"image_embeds": stages["merger"], "deepstack_features.0": stages["deepstack_merger_list.0"],
                 "deepstack_features.1": stages["deepstack_merger_list.1"]})


@pytest.mark.slow
@pytest.mark.parity
def test_2b_preset_parity_with_transformers_at_bucket_512():
    """The released 2B tower (random weights) on two images filling bucket 512: every output
    within TOLERANCE of transformers."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from PIL import Image
    from runtime.inputs.processor import process_images
    from torch_reference import random_vision_state_dict, run_vision_tower

    cfg = PRESETS["qwen3-vl-2b"]
    rng = np.random.default_rng(11)
    images = [Image.fromarray(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)) for _ in range(2)]
    pixels, grid_thw = process_images(images)
    assert len(pixels) == 512
    weights = random_vision_state_dict(cfg, seed=5)
    expected = run_vision_tower(cfg, weights, pixels, grid_thw)
    ours = run_graph(compiled("qwen3-vl-2b", 512), cfg, weights, pixels, grid_thw, 512)
    reference = {"image_embeds": expected["merger"]}
    for k in range(len(cfg.deepstack_visual_indexes)):
        reference[f"deepstack_features.{k}"] = expected[f"deepstack_merger_list.{k}"]
    errors = compare_all(ours, reference)
    assert len(errors) == 1 + len(cfg.deepstack_visual_indexes) == 4
