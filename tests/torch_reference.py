"""Ground truth for the vision tower: Hugging Face transformers' `Qwen3VLVisionModel` run in f32.

Imported only by tests and scripts (needs torch and transformers), never by the package.

- `make_vision_model(cfg)`: the transformers model for a `VisionConfig` (eager attention, f32, eval).
- `random_vision_state_dict(cfg, seed)`: deterministic random weights (numpy Generator) with
  HF checkpoint names (`model.visual.*`), scaled so activations stay O(1) through the tower.
- `run_vision_tower(cfg, state_dict, pixel_values, grid_thw)`: outputs plus every intermediate
  stage (see `stage_keys(cfg)`), captured with forward hooks on the model's own modules.
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np

from emitter.config import CONV_WEIGHT, PRESETS, ROPE_THETA, VisionConfig, weight_schema
from emitter.config import HF_PREFIX as PREFIX


# ---------------------------------------------------------------------------------------------
# torchvision beside the CPU build of torch

_TORCHVISION_OPS = None  # the schema library, kept alive for the life of the process


def import_torchvision():
    """Import torchvision (the backend transformers' `Qwen2VLImageProcessor` runs on) beside
    torch 2.13.0+cpu; None when it is not installed.

    PyPI's torchvision 0.28.0, the release paired with torch 2.13.0, is a CUDA build: its
    compiled ops (`torchvision/_C.so`) need libtorch_cuda and do not load beside the CPU
    build, and `import torchvision` then fails registering a fake kernel for an op that was
    never declared ("operator torchvision::nms does not exist") -- and with it every
    `transformers` module that imports torchvision (modeling_qwen3_vl included). The image
    transforms transformers uses are plain torch. So, only when the compiled ops failed to
    load, declare the schemas of the two ops the import registers kernels for (nms, qnms;
    no kernels: calling them fails) and import again. Must run before anything imports
    torchvision: conftest.py and this module's import do it."""
    global _TORCHVISION_OPS
    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        import torchvision
        return torchvision
    except RuntimeError as e:
        if "torchvision::" not in str(e) or _TORCHVISION_OPS is not None:
            raise
    import torch

    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]  # the half-imported package
    _TORCHVISION_OPS = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        _TORCHVISION_OPS.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision
    return torchvision


import_torchvision()


# ---------------------------------------------------------------------------------------------
# Model


def hf_vision_config(cfg: VisionConfig):
    from transformers import Qwen3VLVisionConfig

    kwargs = cfg.to_hf_vision_config()
    if cfg.rope_theta != ROPE_THETA:
        kwargs["rope_parameters"] = {"rope_type": "axial", "rope_theta": float(cfg.rope_theta)}
    return Qwen3VLVisionConfig(**kwargs, attn_implementation="eager")


def make_vision_model(cfg: VisionConfig):
    """transformers' `Qwen3VLVisionModel` for `cfg`: eager attention, f32, eval mode."""
    import torch
    from transformers import Qwen3VLVisionModel

    hf_cfg = hf_vision_config(cfg)
    model = Qwen3VLVisionModel(hf_cfg).to(torch.float32).eval()
    if model.config._attn_implementation != "eager":
        model.config._attn_implementation = "eager"
    assert abs(float(model.rotary_pos_emb.config.rope_parameters["rope_theta"]) - cfg.rope_theta) < 1e-9
    return model


# ---------------------------------------------------------------------------------------------
# Weights


def hf_weight_shapes(cfg: VisionConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Checkpoint names and shapes in checkpoint order (conv weight in its 5-D HF shape)."""
    return [(name, cfg.conv_shape if name == CONV_WEIGHT else shape) for name, shape in weight_schema(cfg)]


def random_vision_state_dict(cfg: VisionConfig, seed: int) -> dict[str, np.ndarray]:
    """Deterministic random f32 weights with HF names, drawn from `np.random.default_rng(seed)`
    in checkpoint order (so the same seed gives the same weights anywhere).

    Linear / conv weights are normal * gain / sqrt(fan_in) (gain 1 for qkv, fc1 and the conv;
    0.5 for attn.proj and the blocks' fc2, so the residual stream grows slowly), biases
    0.1 * normal, the position table 0.5 * normal, every LayerNorm weight 1 + 0.1 * normal and
    bias 0.1 * normal. With pixels of std ~0.5, every stage has std of order 0.3-3."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in hf_weight_shapes(cfg):
        short = name[len(PREFIX):]
        parts = short.split(".")
        is_norm = any(p in ("norm", "norm1", "norm2") for p in parts)
        z = rng.standard_normal(shape, dtype=np.float32)
        if is_norm and parts[-1] == "weight":
            w = 1.0 + 0.1 * z
        elif parts[-1] == "bias":
            w = 0.1 * z
        elif short == "pos_embed.weight":
            w = 0.5 * z
        else:  # a linear or the conv: fan-in scaling
            fan_in = int(np.prod(shape[1:]))
            gain = 0.5 if short.endswith(("attn.proj.weight", "mlp.linear_fc2.weight")) else 1.0
            w = z * np.float32(gain / np.sqrt(fan_in))
        out[name] = np.ascontiguousarray(w, dtype=np.float32)
    return out


def load_state_dict(model, state_dict: dict[str, np.ndarray]) -> None:
    import torch

    tensors = {}
    for name, value in state_dict.items():
        if not name.startswith(PREFIX):
            raise KeyError(f"{name}: expected the prefix {PREFIX!r}")
        tensors[name[len(PREFIX):]] = torch.from_numpy(np.array(value, dtype=np.float32, copy=True))
    model.load_state_dict(tensors, strict=True)


# ---------------------------------------------------------------------------------------------
# Forward with intermediate stages

MERGER_STAGES = ("norm", "fc1", "act")
BLOCK_STAGES = ("norm1", "attn", "attn_residual", "norm2", "mlp")


def stage_keys(cfg: VisionConfig) -> list[str]:
    """Every key `run_vision_tower` returns, in forward order (DeepStack taps after their block)."""
    keys = ["patch_embed", "pos_embed", "embed"]
    for i in range(cfg.depth):
        keys += [f"blocks.{i}.{s}" for s in BLOCK_STAGES] + [f"blocks.{i}"]
        if i in cfg.deepstack_visual_indexes:
            k = cfg.deepstack_visual_indexes.index(i)
            keys += [f"deepstack_merger_list.{k}.{s}" for s in MERGER_STAGES] + [f"deepstack_merger_list.{k}"]
    keys += [f"merger.{s}" for s in MERGER_STAGES] + ["merger"]
    return keys


def run_vision_tower(cfg: VisionConfig, state_dict: dict[str, np.ndarray], pixel_values: np.ndarray,
                     grid_thw: np.ndarray, model=None) -> dict[str, np.ndarray]:
    """Run transformers' vision tower in f32 and return every stage of `stage_keys(cfg)`
    as f32 numpy copies. `merger` is the model's pooler_output and `deepstack_merger_list.{k}`
    its deepstack_features[k] (checked here)."""
    import torch
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    if model is None:
        model = make_vision_model(cfg)
    load_state_dict(model, state_dict)
    model.eval()

    pixel_values = np.asarray(pixel_values, dtype=np.float32)
    grid_thw = np.asarray(grid_thw, dtype=np.int64)
    n = int(np.prod(grid_thw, axis=1).sum())
    if pixel_values.shape != (n, cfg.patch_dim):
        raise ValueError(f"pixel_values {pixel_values.shape}: expected ({n}, {cfg.patch_dim}) for grid_thw")

    captured: dict[str, torch.Tensor] = {}

    def put(key, tensor):
        if key in captured:
            raise RuntimeError(f"stage {key!r} captured twice")
        captured[key] = tensor.detach().clone()

    def out_hook(key):
        return lambda module, args, output: put(key, output)

    def in_hook(key):
        def hook(module, args, kwargs):
            put(key, args[0] if args else kwargs["hidden_states"])
        return hook

    handles = []
    reg = lambda m, key: handles.append(m.register_forward_hook(out_hook(key)))  # noqa: E731
    reg(model.patch_embed, "patch_embed")
    handles.append(model.blocks[0].register_forward_pre_hook(in_hook("embed"), with_kwargs=True))
    for i, blk in enumerate(model.blocks):
        reg(blk, f"blocks.{i}")
        reg(blk.norm1, f"blocks.{i}.norm1")
        reg(blk.attn, f"blocks.{i}.attn")
        # norm2's input is exactly `hidden_states + attn(norm1(hidden_states))`.
        handles.append(blk.norm2.register_forward_pre_hook(in_hook(f"blocks.{i}.attn_residual"), with_kwargs=True))
        reg(blk.norm2, f"blocks.{i}.norm2")
        reg(blk.mlp, f"blocks.{i}.mlp")
    mergers = [("merger", model.merger)] + [
        (f"deepstack_merger_list.{k}", m) for k, m in enumerate(model.deepstack_merger_list)]
    for key, m in mergers:
        reg(m, key)
        reg(m.norm, f"{key}.norm")
        reg(m.linear_fc1, f"{key}.fc1")
        reg(m.act_fn, f"{key}.act")

    try:
        with torch.no_grad():
            pv = torch.from_numpy(pixel_values.copy())
            grid = torch.from_numpy(grid_thw.copy())
            result = model(pv, grid_thw=grid, return_dict=True)
            # The position embedding that the model adds, computed as its forward does.
            idx, w = get_vision_interpolation_indices_and_weights(
                grid,
                num_grid_per_side=model.num_grid_per_side,
                mode=model.interpolation_mode,
                align_corners=model.interpolation_align_corners,
                spatial_merge_size=model.config.spatial_merge_size,
            )
            captured["pos_embed"] = (model.pos_embed(idx) * w[:, :, None]).sum(1)
    finally:
        for h in handles:
            h.remove()

    # The model's returned outputs are the final stages.
    if not torch.equal(result.pooler_output, captured["merger"]):
        raise AssertionError("captured merger output != pooler_output")
    feats = result.deepstack_features
    if len(feats) != len(cfg.deepstack_visual_indexes):
        raise AssertionError(f"{len(feats)} deepstack features, expected {len(cfg.deepstack_visual_indexes)}")
    for k, f in enumerate(feats):
        if not torch.equal(f, captured[f"deepstack_merger_list.{k}"]):
            raise AssertionError(f"captured deepstack_merger_list.{k} != deepstack_features[{k}]")
    if not torch.equal(result.last_hidden_state, captured[f"blocks.{cfg.depth - 1}"]):
        raise AssertionError("captured last block output != last_hidden_state")
    # The block-0 input is the sum the model formed.
    if not torch.equal(captured["embed"], captured["patch_embed"] + captured["pos_embed"]):
        raise AssertionError("embed != patch_embed + pos_embed")

    keys = stage_keys(cfg)
    if set(keys) != set(captured):
        raise AssertionError(f"stage keys mismatch: missing {set(keys) - set(captured)}, "
                             f"extra {set(captured) - set(keys)}")
    out = {}
    for key in keys:
        arr = np.array(captured[key].numpy(), dtype=np.float32, copy=True)
        if arr.ndim != 2:
            raise AssertionError(f"stage {key}: shape {arr.shape}, expected 2-D")
        out[key] = arr
    return out


# ---------------------------------------------------------------------------------------------
__all__ = ["PRESETS", "import_torchvision", "hf_vision_config", "make_vision_model", "random_vision_state_dict", "run_vision_tower", "stage_keys",
           "hf_weight_shapes", "load_state_dict"]
