"""The bf16 precision policy: matmul operands in bf16, f32 accumulation, norms and
softmax in f32. An option, never the default; part of the artifact identity."""

from __future__ import annotations

import ml_dtypes
import pytest

from conftest import rel_l2
from emitter.config import PRESETS, ConfigError
from emitter.vision import graph_weights
from emitter.vision import emit_vision_module, result_names
from runtime.checkpoints.vision import weights_in_order
from runtime.artifact.compiler import compile_mlir
from runtime.artifact.iree_module import LoadedModule
from runtime.inputs.packing import host_inputs

TINY = PRESETS["tiny"]


def test_bf16_weights_are_the_matmul_weights_only():
    specs = {w.name: w for w in graph_weights(TINY, "bf16")}
    assert specs["model.visual.blocks.0.attn.qkv.weight"].dtype == "bf16"
    assert specs["model.visual.merger.linear_fc2.weight"].dtype == "bf16"
    assert specs["model.visual.patch_embed.proj.weight"].host_transform == "conv3d_flatten+round_to_bf16"
    for name in ("model.visual.pos_embed.weight", "model.visual.blocks.0.norm1.weight",
                 "model.visual.blocks.0.attn.qkv.bias"):
        assert specs[name].dtype == "f32"
    assert all(w.dtype == "f32" for w in graph_weights(TINY))
    with pytest.raises(ConfigError, match="--precision 'f16'"):
        graph_weights(TINY, "f16")


def test_bf16_graph_is_close_to_transformers_f32(tiny_parity):
    """bf16 operands lose about 3 significant digits: the outputs stay within a few 1e-3."""
    weights, pixels, grid_thw, stages = tiny_parity
    flat = {name: weights[name].reshape(shape) for name, shape in
            [(w.name, w.shape) for w in graph_weights(TINY)]}
    args = weights_in_order(flat, TINY, "bf16")
    assert args[0].dtype == ml_dtypes.bfloat16
    module = LoadedModule(compile_mlir(emit_vision_module(TINY, 128, precision="bf16")))
    grids = [tuple(int(v) for v in g) for g in grid_thw]
    results = dict(zip(result_names(TINY), module(*host_inputs(pixels, grids, TINY, 128), *args)))
    merged = len(pixels) // 4
    error = rel_l2(results["image_embeds"][:merged], stages["merger"])
    assert 1e-5 < error < 2e-2, error  # clearly not f32, clearly the same function
    for k in range(2):
        assert rel_l2(results[f"deepstack_features.{k}"][:merged], stages[f"deepstack_merger_list.{k}"]) < 2e-2


def test_bf16_session_with_parameter_bound_weights(tmp_path):
    """bf16 weights served from the parameter archive (raw bytes, any dtype)."""
    from PIL import Image
    from runtime.vision import VisionSession
    from runtime.checkpoints.synthetic import write_checkpoint
    import numpy as np
    write_checkpoint(tmp_path / "m", TINY, seed=3)
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 256, (256, 256, 3), dtype=np.uint8))
    exact = VisionSession(tmp_path / "m", buckets=(256,), cache_dir=tmp_path / "c").encode([picture])
    fast = VisionSession(tmp_path / "m", buckets=(256,), cache_dir=tmp_path / "c", precision="bf16").encode([picture])
    assert 1e-5 < rel_l2(fast.image_embeds, exact.image_embeds) < 2e-2
