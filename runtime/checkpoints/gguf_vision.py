"""A llama.cpp mmproj GGUF (what `convert_hf_to_gguf.py --mmproj` writes for a Qwen3-VL
checkpoint: architecture `clip`, projector `qwen3vl_merger`) read as it is, through the
`gguf` package, beside the GGUF text file (runtime/checkpoints/gguf_text.py):
- the vision config from the `clip.vision.*` keys (DeepStack layers from
  `is_deepstack_layers`, the position table's size from its tensor; the temporal patch is
  the converter's two frames, the activation and rotary base Qwen3-VL's defaults, which the
  file does not store);
- the processor policy: patch size, merge size, image mean and std, and min / max pixels
  where the file names them, the rest (and a missing one) Qwen3-VL's released
  preprocessor_config.json (`emitter.policy.DEFAULT_POLICY`); video: DEFAULT_VIDEO_POLICY;
- the tensors `v.*` / `mm.*` under their Hugging Face names (`hf_name`, the one place
  llama.cpp's names are mapped; `v.deepstack.{layer}` re-indexed into the merger list, the
  patch embedding's two frames `v.patch_embd.weight` / `.weight.1` rejoined along time),
  each exact f32 (F32, F16, BF16 widened, the quantized types by `gguf.quants.dequantize`),
  or for the quantized linears under `native` in their bits (`native_weights`: the layouts
  gguf_text.py gives the decoder's, runtime/checkpoints/gguf_blocks.py).
Every problem is a one-line `CheckpointError` naming the file and the tensor.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from emitter.config import CONV_WEIGHT, HF_PREFIX, MATMUL_WEIGHT_SUFFIXES, VisionConfig, weight_schema
from emitter.vision import graph_weights
from runtime.checkpoints import gguf_text
from runtime.checkpoints.vision import CheckpointError, weights_in_order

ARCH = "clip"
PROJECTOR = "qwen3vl_merger"
PATCH = "v.patch_embd.weight"  # frame 0; frame 1 is PATCH + ".1"
GLOBAL_NAMES = {"v.patch_embd.bias": HF_PREFIX + "patch_embed.proj.bias",
                "v.position_embd.weight": HF_PREFIX + "pos_embed.weight",
                "v.post_ln.weight": HF_PREFIX + "merger.norm.weight", "v.post_ln.bias": HF_PREFIX + "merger.norm.bias",
                "mm.0.weight": HF_PREFIX + "merger.linear_fc1.weight", "mm.0.bias": HF_PREFIX + "merger.linear_fc1.bias",
                "mm.2.weight": HF_PREFIX + "merger.linear_fc2.weight", "mm.2.bias": HF_PREFIX + "merger.linear_fc2.bias"}
BLOCK_NAMES = {"ln1": "norm1", "ln2": "norm2", "attn_qkv": "attn.qkv", "attn_out": "attn.proj",
               "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}
DEEPSTACK_NAMES = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}
KEY = "clip.vision."


def mmproj_file(model) -> Path | None:
    """The mmproj GGUF beside a GGUF text model: the one `mmproj*.gguf` of a folder without
    config.json; None for anything else (a text file alone, a Hugging Face folder)."""
    path = Path(model)
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.glob("*.gguf") if p.name.lower().startswith("mmproj"))
    if len(found) > 1:
        raise CheckpointError(f"--model {path}: {len(found)} mmproj files ({', '.join(p.name for p in found)}); "
                              "expected one beside the text file")
    return found[0] if found else None


def reader(path):
    """The mmproj's `gguf.GGUFReader` (`gguf_text.parsed`), its architecture and projector checked."""
    try:
        r = gguf_text.parsed(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None
    arch = gguf_text.field(r, "general.architecture", path)
    if arch != ARCH:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not an mmproj; expected {ARCH!r} "
                              "(convert_hf_to_gguf.py --mmproj)")
    projector = gguf_text.field(r, "clip.projector_type", path, "")
    if projector != PROJECTOR:
        raise CheckpointError(f"{path}: projector type {projector!r} is not supported; expected {PROJECTOR!r} "
                              "(the Qwen3-VL vision tower)")
    return r


def deepstack_indexes(r, path) -> tuple[int, ...]:
    """The blocks whose output feeds a DeepStack merger (`is_deepstack_layers`)."""
    flags = gguf_text.field(r, KEY + "is_deepstack_layers", path, [])
    return tuple(i for i, on in enumerate(flags) if on)


def vision_config(path) -> VisionConfig:
    """The vision config of an mmproj GGUF (module docstring)."""
    r = reader(path)
    key = lambda k: gguf_text.field(r, KEY + k, path)  # noqa: E731
    pos = next((t for t in r.tensors if t.name == "v.position_embd.weight"), None)
    if pos is None:
        raise CheckpointError(f"{path}: the tensor v.position_embd.weight is missing")
    return VisionConfig(depth=int(key("block_count")), hidden_size=int(key("embedding_length")),
                        intermediate_size=int(key("feed_forward_length")), out_hidden_size=int(key("projection_dim")),
                        num_heads=int(key("attention.head_count")), deepstack_visual_indexes=deepstack_indexes(r, path),
                        patch_size=int(key("patch_size")), spatial_merge_size=int(key("spatial_merge_size")),
                        num_position_embeddings=int(pos.shape[1]))


def checked_config(path) -> VisionConfig:
    """`vision_config`, every tensor it needs present and of a supported type (`vision_tensors`)."""
    cfg = vision_config(path)
    vision_tensors(path, cfg)
    return cfg


def vision_parts(path):
    """(config, image policy, video policy) of an mmproj: `checked_config`, `processor_policy`
    and Qwen3-VL's video policy (the file stores none): what the build and the generator read."""
    from emitter.video_policy import DEFAULT_VIDEO_POLICY

    cfg = checked_config(path)
    return cfg, processor_policy(path, cfg), DEFAULT_VIDEO_POLICY


def processor_policy(path, cfg: VisionConfig):
    """The image processor policy (module docstring)."""
    from emitter.policy import DEFAULT_POLICY

    r = reader(path)
    found = {name: r.fields[KEY + key].contents() for name, key in (
        ("image_mean", "image_mean"), ("image_std", "image_std"), ("min_pixels", "image_min_pixels"),
        ("max_pixels", "image_max_pixels")) if KEY + key in r.fields}
    values = {k: tuple(v) if isinstance(v, list) else int(v) for k, v in found.items()}
    return dataclasses.replace(DEFAULT_POLICY, patch_size=cfg.patch_size, merge_size=cfg.spatial_merge_size,
                               temporal_patch_size=cfg.temporal_patch_size, **values)


def hf_name(name: str, deepstack: tuple[int, ...]) -> str | None:
    """The Hugging Face name of one of llama.cpp's mmproj tensor names (the patch
    embedding's frames both map to the conv), or None."""
    if name in (PATCH, PATCH + ".1"):
        return CONV_WEIGHT
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 5 and parts[:2] == ["v", "blk"] and parts[2].isdigit() and parts[3] in BLOCK_NAMES:
        return f"{HF_PREFIX}blocks.{parts[2]}.{BLOCK_NAMES[parts[3]]}.{parts[4]}"
    if (len(parts) == 5 and parts[:2] == ["v", "deepstack"] and parts[2].isdigit()
            and int(parts[2]) in deepstack and parts[3] in DEEPSTACK_NAMES):
        k = deepstack.index(int(parts[2]))
        return f"{HF_PREFIX}deepstack_merger_list.{k}.{DEEPSTACK_NAMES[parts[3]]}.{parts[4]}"
    return None


def vision_tensors(path, cfg: VisionConfig) -> dict:
    """{llama.cpp name: the reader's tensor} of every tensor the config needs, each known and
    of a supported type; CheckpointError naming the first that is not, or is missing."""
    r = reader(path)
    found = {}
    for t in r.tensors:
        if hf_name(t.name, cfg.deepstack_visual_indexes) is None:
            raise CheckpointError(f"{t.name}: a tensor of {path} that a Qwen3-VL vision tower does not have")
        gguf_text.check_type(t, path)
        found[t.name] = t
    wanted = {hf_name(n, cfg.deepstack_visual_indexes) for n in found}
    for name, _ in weight_schema(cfg):
        if name not in wanted:
            gguf_name = next((g for g, h in _names(cfg) if h == name), name)
            raise CheckpointError(f"{path}: the tensor {gguf_name} (for {name}) is missing")
    for frame in (PATCH, PATCH + ".1"):
        if frame not in found:
            raise CheckpointError(f"{path}: the tensor {frame} (for {CONV_WEIGHT}) is missing")
    return found


def _names(cfg: VisionConfig):
    """(llama.cpp name, Hugging Face name) of every tensor the config needs."""
    out = [(PATCH, CONV_WEIGHT), *((g, h) for g, h in GLOBAL_NAMES.items())]
    for b in range(cfg.depth):
        out += [(f"v.blk.{b}.{g}.{s}", f"{HF_PREFIX}blocks.{b}.{h}.{s}") for g, h in BLOCK_NAMES.items()
                for s in ("weight", "bias")]
    for k, layer in enumerate(cfg.deepstack_visual_indexes):
        out += [(f"v.deepstack.{layer}.{g}.{s}", f"{HF_PREFIX}deepstack_merger_list.{k}.{h}.{s}")
                for g, h in DEEPSTACK_NAMES.items() for s in ("weight", "bias")]
    return out


def load_vision_weights(path, cfg: VisionConfig, skip=()) -> dict[str, np.ndarray]:
    """The graph's weights (but those named in `skip`) as exact f32 (`gguf_text.dequantized`)
    keyed by Hugging Face name in `weight_schema(cfg)` order, each of the shape the graph
    takes: the conv's two frames stacked along time and flattened to [hidden, patch_dim] in
    (C, T, P, P) order."""
    tensors = vision_tensors(path, cfg)
    by_hf = {hf_name(n, cfg.deepstack_visual_indexes): t for n, t in tensors.items() if n != PATCH + ".1"}
    out = {}
    for name, shape in weight_schema(cfg):
        if name in skip:
            continue
        if name == CONV_WEIGHT:
            frames = [gguf_text.dequantized(tensors[f]) for f in (PATCH, PATCH + ".1")]
            w = np.stack(frames, axis=2)  # [h, C, P, P] x 2 -> [h, C, T, P, P]
        else:
            w = gguf_text.dequantized(by_hf[name])
        if w.size != int(np.prod(shape)) or (name != CONV_WEIGHT and w.shape != tuple(shape)):
            raise CheckpointError(f"{name}: shape {list(w.shape)} (expected {list(shape)}) (in {path})")
        if not np.isfinite(w).all():
            raise CheckpointError(f"{name}: non-finite values (in {path})")
        out[name] = np.ascontiguousarray(w.reshape(shape), dtype=np.float32)
    return out


def native_weights(path, cfg: VisionConfig) -> tuple[tuple, ...]:
    """The entries of the quantized linears, each in its own bits (`gguf_text.native_entries`,
    `VisionConfig.native_weights`)."""
    return gguf_text.native_entries(by_hf_name(path, cfg), lambda name: name.endswith(MATMUL_WEIGHT_SUFFIXES))


def by_hf_name(path, cfg: VisionConfig) -> dict:
    """{Hugging Face name: the reader's tensor} (`vision_tensors`; the conv's frame 0)."""
    return {hf_name(n, cfg.deepstack_visual_indexes): t for n, t in vision_tensors(path, cfg).items()
            if n != PATCH + ".1"}


def vision_arrays(path, cfg: VisionConfig, precision: str = "f32") -> list[np.ndarray]:
    """The graph's ordered weight arguments: those of `cfg.native_weights` in their bits
    (`gguf_text.native_arrays`: q, then its scales and any biases), the rest as
    `load_vision_weights` gives them through `vision.weights_in_order` (f32, or bf16)."""
    native = {entry[0] for entry in cfg.native_weights}
    if not native:
        return weights_in_order(load_vision_weights(path, cfg), cfg, precision)
    tensors = by_hf_name(path, cfg)
    widened = load_vision_weights(path, cfg, skip=native)  # no f32 copy of the linears in their bits
    out, pending = [], {}
    for w in graph_weights(cfg, precision):
        if w.name in pending:  # made with its weight, just before
            out.append(pending.pop(w.name))
        elif w.name in native:
            out.append(gguf_text.native_arrays(w.name, tensors[w.name], pending))
        else:
            out.append(widened[w.name])
    return out


def content_fields(path, digest) -> dict:
    """What decides a vision archive's bytes from this file: its sha256, `digest(file)`."""
    return {"mmproj_sha256": digest(path)}


def paired_model(model, mmproj, cache_root) -> Path:
    """`--model TEXT.gguf --mmproj FILE` as the folder form every command reads: a folder
    under `cache_root/gguf-pairs` (named by the two files' absolute paths) holding links to
    both, its own name the text file's stem; the two files checked first (one line each)."""
    import hashlib
    import os

    text, mmproj = Path(model).resolve(), Path(mmproj).resolve()
    if gguf_text.text_file(model) != Path(model) or Path(model).is_dir():
        raise CheckpointError(f"--mmproj {mmproj}: expected with --model naming a GGUF text file, not {model} "
                              "(a folder holds its mmproj itself)")
    if not gguf_text.starts_gguf(mmproj):
        raise CheckpointError(f"--mmproj {mmproj}: not a GGUF file; expected llama.cpp's mmproj-*.gguf")
    reader(mmproj)
    key = hashlib.sha256(f"{text}\0{mmproj}".encode()).hexdigest()[:16]
    folder = Path(cache_root) / "gguf-pairs" / key / text.stem
    links = {folder / text.name: text, folder / ("mmproj-" + mmproj.name if not mmproj.name.lower().startswith(
        "mmproj") else mmproj.name): mmproj}
    folder.mkdir(parents=True, exist_ok=True)
    for link, target in links.items():
        if not link.is_symlink():
            tmp = link.with_name(link.name + f".{os.getpid()}.tmp")
            tmp.symlink_to(target)
            tmp.rename(link)  # whole or not at all
    return folder
