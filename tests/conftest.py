"""Shared test helpers: compiled tiny modules (compiled once per session) and the graph runner."""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))  # torch_reference, helpers

from emitter.config import PRESETS, weight_schema  # noqa: E402
from emitter.vision import emit_vision_module, result_names  # noqa: E402
from runtime.artifact.compiler import compile_mlir  # noqa: E402
from runtime.artifact.iree_module import LoadedModule  # noqa: E402
from runtime.inputs.packing import host_inputs  # noqa: E402
# Under `make test`, a skip whose reason require_references.ALLOWED_SKIPS does not name fails.
from require_references import pytest_runtest_makereport  # noqa: E402,F401

FIXTURES = TESTS / "fixtures"

# The reference implementations the suite checks against. `make test` installs them and
# sets QWEN3VL_REQUIRE_REFERENCES=1, so that a missing one fails the run instead of
# silently skipping the checks that need it.
REFERENCE_MODULES = ("torch", "transformers", "torchvision", "ray", "mlx", "mlx_vlm")


def pytest_sessionstart(session):
    import importlib
    import os
    from torch_reference import import_torchvision
    import_torchvision()  # before anything imports it: PyPI's build needs this beside the CPU torch
    if os.environ.get("QWEN3VL_REQUIRE_REFERENCES") != "1":
        return
    for name in REFERENCE_MODULES:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any import failure is a broken install
            raise pytest.UsageError(f"QWEN3VL_REQUIRE_REFERENCES=1 but {name} does not import ({e}); "
                                    f"run `make test-deps`") from None


@lru_cache(maxsize=None)
def compiled(preset: str, bucket: int, diagnostics: bool = False, inspect=None) -> LoadedModule:
    cfg = PRESETS[preset]
    return LoadedModule(compile_mlir(emit_vision_module(cfg, bucket, diagnostics, inspect)))


def graph_weights(cfg, state_dict) -> list[np.ndarray]:
    """HF state dict -> graph weight arguments (conv flattened to [hidden, patch_dim])."""
    return [np.ascontiguousarray(state_dict[name].reshape(shape), dtype=np.float32)
            for name, shape in weight_schema(cfg)]


def run_graph(module: LoadedModule, cfg, state_dict, pixel_values, grid_thw, bucket, diagnostics=False,
              inspect=None) -> dict[str, np.ndarray]:
    """Run a compiled graph on one packed call; results by name, trimmed to the real rows."""
    grids = [tuple(int(v) for v in g) for g in grid_thw]
    n = sum(t * h * w for t, h, w in grids)
    inputs = host_inputs(pixel_values, grids, cfg, bucket)
    results = module(*inputs, *graph_weights(cfg, state_dict))
    names = result_names(cfg, diagnostics, inspect)
    assert len(results) == len(names)
    out = {}
    for name, value in zip(names, results):
        rows = n if value.shape[0] == len(inputs[0]) else n // cfg.merge_unit
        out[name] = value[:rows]
    return out


def rel_l2(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


@pytest.fixture(scope="session")
def tiny_parity():
    from safetensors.numpy import load_file
    data = load_file(FIXTURES / "tiny_parity.safetensors")
    weights = {k[len("weight."):]: v for k, v in data.items() if k.startswith("weight.")}
    stages = {k[len("stage."):]: v for k, v in data.items() if k.startswith("stage.")}
    return weights, data["pixel_values"], data["grid_thw"], stages


@pytest.fixture(scope="session")
def serve_cache(tmp_path_factory):
    """One artifact cache for every `qwen3vl serve` the tests start: compiled once a session."""
    return tmp_path_factory.mktemp("serve-cache")
