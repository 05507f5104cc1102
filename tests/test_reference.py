"""The numpy reference against transformers: committed fixture and live."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import rel_l2
from emitter.config import PRESETS
from runtime.oracle.reference import Reference

TINY = PRESETS["tiny"]


@pytest.mark.parametrize("dtype, tolerance", [(np.float32, 1e-5), (np.float64, 1e-5)])
def test_reference_matches_fixture_stage_by_stage(tiny_parity, dtype, tolerance):
    weights, pixels, grid_thw, expected = tiny_parity
    ours = Reference(TINY, weights, dtype).run(pixels, grid_thw)
    assert set(expected) <= set(ours)
    errors = {k: rel_l2(ours[k], v) for k, v in expected.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tolerance, (worst, errors[worst])
    assert ours["merger"].dtype == dtype


def test_block_recompute_on_given_input_equals_run(tiny_parity):
    weights, pixels, grid_thw, _ = tiny_parity
    ref = Reference(TINY, weights)
    stages = ref.run(pixels, grid_thw)
    again = ref.block(2, stages["blocks.1"], grid_thw)
    np.testing.assert_array_equal(again["out"], stages["blocks.2"])


@pytest.mark.parity
def test_reference_live_against_transformers():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from torch_reference import random_vision_state_dict, run_vision_tower

    grid_thw = np.array([[1, 10, 6], [1, 2, 2], [3, 4, 2]])
    n = int(np.prod(grid_thw, axis=1).sum())
    pixels = np.random.default_rng(11).uniform(-1, 1, (n, TINY.patch_dim)).astype(np.float32)
    weights = random_vision_state_dict(TINY, seed=5)
    expected = run_vision_tower(TINY, weights, pixels, grid_thw)
    ours = Reference(TINY, weights).run(pixels, grid_thw)
    for name, value in expected.items():
        assert rel_l2(ours[name], value) <= 1e-5, name
