"""An eager numpy reference of the vision tower, stage by stage.

Written from the reference math (`docs/reference-math.md`), independently of
the emitter's graph: no bucket padding, position embedding by per-image linspace and
reorder, attention per segment (no mask). f32 by default; f64 on request.
Stage names match the diagnostics variant (`emitter.vision.stage_names`).
"""

from __future__ import annotations

import math

import numpy as np

from emitter.config import HF_PREFIX, LAYER_NORM_EPS, VisionConfig



def layer_norm(x, weight, bias, eps=LAYER_NORM_EPS):
    mean = x.mean(axis=-1, keepdims=True)
    centered = x - mean
    variance = (centered * centered).mean(axis=-1, keepdims=True)
    return centered / np.sqrt(variance + x.dtype.type(eps)) * weight + bias


def gelu_tanh(x):
    c = x.dtype.type(math.sqrt(2.0 / math.pi))
    return x.dtype.type(0.5) * x * (1 + np.tanh(c * (x + x.dtype.type(0.044715) * x ** 3)))


def gelu_erf(x):
    erf = np.vectorize(math.erf, otypes=[np.float64])
    return (x.astype(np.float64) * 0.5 * (1.0 + erf(x.astype(np.float64) / math.sqrt(2.0)))).astype(x.dtype)


def linear(x, w, b):
    return x @ w.T + b


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def to_merge_windows(grid_hw: np.ndarray, merge: int) -> np.ndarray:
    """[h, w, ...] row-major -> [h*w, ...] in merge-window order (h/m, w/m, m, m)."""
    h, w = grid_hw.shape[:2]
    x = grid_hw.reshape(h // merge, merge, w // merge, merge, *grid_hw.shape[2:])
    return x.swapaxes(1, 2).reshape(h * w, *grid_hw.shape[2:])


def position_embedding(table: np.ndarray, grid, cfg: VisionConfig) -> np.ndarray:
    """Bilinear (aligned corners) resample of the square table to an (h, w) grid, per frame."""
    t, h, w = grid
    side = cfg.grid_side
    square = table.reshape(side, side, -1)
    hs = np.linspace(0, side - 1, h, dtype=np.float32) if h > 1 else np.zeros(1, np.float32)
    ws = np.linspace(0, side - 1, w, dtype=np.float32) if w > 1 else np.zeros(1, np.float32)
    h0, w0 = np.floor(hs).astype(int), np.floor(ws).astype(int)
    h1, w1 = np.minimum(h0 + 1, side - 1), np.minimum(w0 + 1, side - 1)
    dh, dw = (hs - h0).astype(table.dtype)[:, None, None], (ws - w0).astype(table.dtype)[None, :, None]
    one = table.dtype.type(1)
    blended = (square[h0][:, w0] * ((one - dh) * (one - dw)) + square[h0][:, w1] * ((one - dh) * dw)
               + square[h1][:, w0] * (dh * (one - dw)) + square[h1][:, w1] * (dh * dw))
    return np.tile(to_merge_windows(blended, cfg.spatial_merge_size), (t, 1))


def rotary(grid, cfg: VisionConfig, dtype) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [t*h*w, head_dim] for one image: angles cat(row*f, col*f) twice."""
    t, h, w = grid
    rd = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, rd, 2, dtype=np.float32) / np.float32(rd)))
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    ids = to_merge_windows(np.stack([rows, cols], axis=-1), cfg.spatial_merge_size)
    angles = np.concatenate([ids[:, :1] * inv_freq, ids[:, 1:] * inv_freq], axis=1).astype(np.float32)
    angles = np.tile(np.concatenate([angles, angles], axis=1), (t, 1))
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def attention(x, w, cos, sin, segments, num_heads):
    n, hidden = x.shape
    head_dim = hidden // num_heads
    q, k, v = linear(x, w["attn.qkv.weight"], w["attn.qkv.bias"]).reshape(n, 3, num_heads, head_dim).transpose(1, 0, 2, 3)
    q = q * cos[:, None] + rotate_half(q) * sin[:, None]
    k = k * cos[:, None] + rotate_half(k) * sin[:, None]
    out = np.empty_like(q)
    scale = x.dtype.type(head_dim ** -0.5)
    for start, stop in segments:
        qs, ks, vs = (a[start:stop].transpose(1, 0, 2) for a in (q, k, v))  # [heads, len, d]
        probs = softmax(qs @ ks.transpose(0, 2, 1) * scale)
        out[start:stop] = (probs @ vs).transpose(1, 0, 2)
    return linear(out.reshape(n, hidden), w["attn.proj.weight"], w["attn.proj.bias"])


def block_stages(x, w, cos, sin, segments, cfg: VisionConfig) -> dict[str, np.ndarray]:
    """Inner stages of one block, from its input `x`."""
    norm1 = layer_norm(x, w["norm1.weight"], w["norm1.bias"])
    attn = attention(norm1, w, cos, sin, segments, cfg.num_heads)
    attn_residual = x + attn
    norm2 = layer_norm(attn_residual, w["norm2.weight"], w["norm2.bias"])
    mlp = linear(gelu_tanh(linear(norm2, w["mlp.linear_fc1.weight"], w["mlp.linear_fc1.bias"])),
                 w["mlp.linear_fc2.weight"], w["mlp.linear_fc2.bias"])
    return {"norm1": norm1, "attn": attn, "attn_residual": attn_residual, "norm2": norm2, "mlp": mlp,
            "out": attn_residual + mlp}


def merger_stages(x, w, cfg: VisionConfig, postshuffle_norm: bool) -> dict[str, np.ndarray]:
    width = cfg.merged_hidden_size
    if postshuffle_norm:
        norm = layer_norm(x.reshape(-1, width), w["norm.weight"], w["norm.bias"])
        grouped = norm
    else:
        norm = layer_norm(x, w["norm.weight"], w["norm.bias"])
        grouped = norm.reshape(-1, width)
    fc1 = linear(grouped, w["linear_fc1.weight"], w["linear_fc1.bias"])
    act = gelu_erf(fc1)
    return {"norm": norm, "fc1": fc1, "act": act, "out": linear(act, w["linear_fc2.weight"], w["linear_fc2.bias"])}


class Reference:
    """The tower on one set of weights (HF names, conv either 5-D or flattened)."""

    def __init__(self, cfg: VisionConfig, weights: dict[str, np.ndarray], dtype=np.float32):
        self.cfg, self.dtype = cfg, np.dtype(dtype)
        self.w = {k[len(HF_PREFIX):] if k.startswith(HF_PREFIX) else k: np.asarray(v).astype(self.dtype)
                  for k, v in weights.items()}
        self.w["patch_embed.proj.weight"] = self.w["patch_embed.proj.weight"].reshape(cfg.hidden_size, -1)

    def group(self, prefix: str) -> dict[str, np.ndarray]:
        return {k[len(prefix):]: v for k, v in self.w.items() if k.startswith(prefix)}

    def inputs(self, grid_thw):
        """Per-patch rotary tables and the attention segments (one per frame)."""
        cos, sin, segments, start = [], [], [], 0
        for t, h, w in (tuple(int(v) for v in g) for g in grid_thw):
            c, s = rotary((t, h, w), self.cfg, self.dtype)
            cos.append(c)
            sin.append(s)
            for _ in range(t):
                segments.append((start, start + h * w))
                start += h * w
        return np.concatenate(cos), np.concatenate(sin), segments

    def block(self, i: int, x, grid_thw) -> dict[str, np.ndarray]:
        cos, sin, segments = self.inputs(grid_thw)
        return block_stages(x.astype(self.dtype), self.group(f"blocks.{i}."), cos, sin, segments, self.cfg)

    def run(self, pixel_values, grid_thw) -> dict[str, np.ndarray]:
        """Every stage, named as in the diagnostics variant."""
        cfg, w = self.cfg, self.w
        grids = [tuple(int(v) for v in g) for g in grid_thw]
        stages = {"patch_embed": linear(pixel_values.astype(self.dtype), w["patch_embed.proj.weight"],
                                        w["patch_embed.proj.bias"])}
        stages["pos_embed"] = np.concatenate([position_embedding(w["pos_embed.weight"], g, cfg) for g in grids])
        x = stages["embed"] = stages["patch_embed"] + stages["pos_embed"]
        cos, sin, segments = self.inputs(grids)
        for i in range(cfg.depth):
            inner = block_stages(x, self.group(f"blocks.{i}."), cos, sin, segments, cfg)
            x = stages[f"blocks.{i}"] = inner.pop("out")
            stages.update({f"blocks.{i}.{k}": v for k, v in inner.items()})
            if i in cfg.deepstack_visual_indexes:
                name = f"deepstack_merger_list.{cfg.deepstack_visual_indexes.index(i)}"
                self._merger(stages, name, x, True)
        self._merger(stages, "merger", x, False)
        return stages

    def _merger(self, stages, name, x, postshuffle_norm):
        inner = merger_stages(x, self.group(name + "."), self.cfg, postshuffle_norm)
        stages[name] = inner.pop("out")
        stages.update({f"{name}.{k}": v for k, v in inner.items()})
