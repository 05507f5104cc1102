"""The DeepStack prefill payload: what a Qwen3-VL language model needs, besides its own
weights, to prefill a prompt that holds images whose vision features came from here.

- `expand_image_pads`: one `<|image_pad|>` per image (as a chat template writes it)
  becomes t*h*w/merge**2 pads per image, the count the merged features fill.
- `mrope_position_ids`: the [3, S] interleaved M-RoPE position ids and the rope delta,
  the same as transformers' `Qwen3VLModel.get_rope_index`.
- `build_prefill_payload`: checks everything against everything else and fails closed
  (`PrefillError`) on any mismatch: pad counts, embed rows, DeepStack feature count and
  shapes, per-image pad runs.
- `scatter_image_embeds`, `add_deepstack`: the two places the payload enters the language
  model (transformers' `masked_scatter` of the image embeds, `_deepstack_process` after
  decoder layers 0..K-1).
- `save_payload` / `load_payload`: one safetensors file, written atomically.

numpy only; torch and transformers are the parity reference in the tests, never imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from emitter.atomic import write_atomic
from emitter.text_config import TokenIds

# mm_token_type_ids values transformers' processor gives (text 0, image 1, video 2).
_TEXT, _IMAGE, _VIDEO = 0, 1, 2

PAYLOAD_FORMAT = "qwen3vl-prefill-payload"
PAYLOAD_VERSION = "1"
PAYLOAD_KEYS = ("input_ids", "visual_positions", "image_embeds", "deepstack_features", "deepstack_layers",
                "position_ids", "rope_delta")


class PrefillError(ValueError):
    """Inputs that do not make a consistent prefill; the one-line message says what and where."""


# --------------------------------------------------------------------------- validation


def _as_ids(input_ids, name: str = "input_ids") -> np.ndarray:
    ids = np.asarray(input_ids)
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1:
        raise PrefillError(f"{name}: expected one sequence of shape [S] (or [1, S]), got shape {list(ids.shape)}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise PrefillError(f"{name}: expected integer token ids, got dtype {ids.dtype}")
    return ids.astype(np.int64, copy=False)


def _as_grids(grid_thw, merge_size: int, what: str = "image") -> list[tuple[int, int, int]]:
    if not isinstance(merge_size, (int, np.integer)) or isinstance(merge_size, bool) or merge_size <= 0:
        raise PrefillError(f"merge_size = {merge_size!r}: expected a positive integer")
    if grid_thw is None:
        return []
    g = np.asarray(grid_thw)
    if g.size == 0:
        return []
    if g.ndim == 1 and g.shape[0] == 3:
        g = g[None]
    if g.ndim != 2 or g.shape[1] != 3:
        raise PrefillError(f"{what} grid_thw: expected shape [n, 3], got {list(g.shape)}")
    if not np.issubdtype(g.dtype, np.integer):
        raise PrefillError(f"{what} grid_thw: expected integers, got dtype {g.dtype}")
    grids = []
    for i, (t, h, w) in enumerate(g.tolist()):
        if min(t, h, w) <= 0:
            raise PrefillError(f"{what} {i}: grid_thw {(t, h, w)} has a non-positive size")
        if h % merge_size or w % merge_size:
            raise PrefillError(f"{what} {i}: grid_thw {(t, h, w)}: h and w must be multiples of "
                               f"merge_size {merge_size}")
        grids.append((int(t), int(h), int(w)))
    return grids


def merged_count(grid, merge_size: int = 2) -> int:
    """Merged tokens (image-pad tokens, embed rows) of one image: t*h*w / merge_size**2."""
    t, h, w = grid
    return t * h * w // merge_size**2


def _runs(types: np.ndarray) -> list[tuple[int, int, int]]:
    """(type, start, end) of each maximal run of equal values, in order."""
    if types.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(types)) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [types.size]])
    return [(int(types[s]), int(s), int(e)) for s, e in zip(starts, ends)]


def _as_features(x, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 2:
        raise PrefillError(f"{name}: expected shape [M, D], got {list(a.shape)}")
    if not np.issubdtype(a.dtype, np.floating):
        raise PrefillError(f"{name}: expected floating-point features, got dtype {a.dtype}")
    if not np.isfinite(a).all():
        bad = int(np.flatnonzero(~np.isfinite(a).all(axis=1))[0])
        raise PrefillError(f"{name}: non-finite values (first in row {bad})")
    return a


# --------------------------------------------------------------------------- prompt


def expand_image_pads(input_ids, grid_thw, merge_size: int = 2, *, token_ids: TokenIds) -> np.ndarray:
    """Replace the single `<|image_pad|>` of each image with t*h*w/merge_size**2 of them
    (the ids are the checkpoint's, `token_ids`).

    Each pad must stand alone between `<|vision_start|>` and `<|vision_end|>` (the chat
    template's form); images are taken in prompt order. Other tokens (video pads too)
    are kept as they are."""
    ids = _as_ids(input_ids)
    grids = _as_grids(grid_thw, merge_size)
    pad = token_ids.image_token_id
    pads = np.flatnonzero(ids == pad)
    runs = [(s, e) for kind, s, e in _runs((ids == pad).astype(np.int8)) if kind == 1]
    for s, e in runs:
        if e - s > 1:
            raise PrefillError(f"input_ids: {e - s} adjacent <|image_pad|> tokens at {s}..{e - 1}; expected one per "
                               "image (already expanded?)")
    if len(pads) != len(grids):
        raise PrefillError(f"input_ids: {len(pads)} <|image_pad|> token(s) but {len(grids)} image grid(s) given")
    for n, i in enumerate(pads.tolist()):
        if i == 0 or ids[i - 1] != token_ids.vision_start_token_id or i + 1 == ids.size or \
                ids[i + 1] != token_ids.vision_end_token_id:
            raise PrefillError(f"input_ids: <|image_pad|> of image {n} at {i} is not wrapped as "
                               "<|vision_start|><|image_pad|><|vision_end|>")
    pieces, prev = [], 0
    for i, grid in zip(pads.tolist(), grids):
        pieces += [ids[prev:i], np.full(merged_count(grid, merge_size), pad, np.int64)]
        prev = i + 1
    pieces.append(ids[prev:])
    return np.concatenate(pieces)


def mrope_position_ids(input_ids, grid_thw, merge_size: int = 2, *, image_token_id: int, video_token_id: int,
                       video_grid_thw=None, attention_mask=None) -> tuple[np.ndarray, int]:
    """M-RoPE position ids [3, S] int64 and the rope delta of one sequence, as transformers'
    `Qwen3VLModel.get_rope_index` computes them (with `mm_token_type_ids` as its processor
    makes them: image pad 1, video pad 2, everything else 0).

    Walk the runs of equal token type with a running position p (from 0):
    a text run of n tokens gets p..p+n-1 on all three axes, p += n; an image run (grid
    t, h, w; H = h/merge, W = w/merge) gets t = p + frame, h = p + row, w = p + col in
    (frame, row, col) row-major order, then p += max(H, W) (the frame count is not
    added: Qwen3-VL images have t = 1). A video of T frames is T grids (1, h, w), one per
    run of video pads (the processor puts a timestamp and vision_end/start between frames).
    rope_delta = max(position) + 1 - (number of unmasked tokens).

    With `attention_mask` [S] (1 keep, 0 pad), positions are computed over the kept
    tokens only and the masked slots hold 0, as in transformers. `image_token_id` /
    `video_token_id`: the checkpoint's pad ids (config.json, `TokenIds`).

    Fails closed where transformers would silently misalign: every vision run must have
    exactly its grid's merged token count, and every grid must be used."""
    ids = _as_ids(input_ids)
    queues = {_IMAGE: _as_grids(grid_thw, merge_size, "image"),
              _VIDEO: [(1, h, w) for t, h, w in _as_grids(video_grid_thw, merge_size, "video") for _ in range(t)]}
    if attention_mask is None:
        keep = np.ones(ids.shape, bool)
    else:
        mask = np.asarray(attention_mask)
        if mask.ndim == 2 and mask.shape[0] == 1:
            mask = mask[0]
        if mask.shape != ids.shape:
            raise PrefillError(f"attention_mask: shape {list(mask.shape)} does not match input_ids {list(ids.shape)}")
        if not np.isin(mask, (0, 1)).all():
            raise PrefillError("attention_mask: expected only 0 and 1")
        keep = mask.astype(bool)
    kept = ids[keep]
    if kept.size == 0:
        raise PrefillError("input_ids: no (unmasked) tokens")
    types = np.zeros(kept.shape, np.int8)
    types[kept == image_token_id] = _IMAGE
    types[kept == video_token_id] = _VIDEO
    kept_index = np.flatnonzero(keep)

    used = {_IMAGE: 0, _VIDEO: 0}
    names = {_IMAGE: ("image", "<|image_pad|>"), _VIDEO: ("video frame", "<|video_pad|>")}
    pieces, pos = [], 0
    for kind, s, e in _runs(types):
        n = e - s
        if kind == _TEXT:
            pieces.append(np.broadcast_to(np.arange(pos, pos + n, dtype=np.int64), (3, n)))
            pos += n
            continue
        what, token = names[kind]
        k = used[kind]
        where = f"tokens {kept_index[s]}..{kept_index[e - 1]}"
        if k == len(queues[kind]):
            raise PrefillError(f"input_ids: {token} run #{k} at {where} has no grid_thw entry "
                               f"({len(queues[kind])} {what} grid(s) given)")
        t, h, w = queues[kind][k]
        gh, gw = h // merge_size, w // merge_size
        if n != t * gh * gw:
            raise PrefillError(f"input_ids: {what} {k} (grid_thw {(t, h, w)}) needs {t * gh * gw} {token} tokens "
                               f"but the run at {where} has {n} (expand_image_pads first? images need a "
                               "separator between them)")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        pieces.append(np.stack([tt, hh, ww]).reshape(3, -1).astype(np.int64) + pos)
        pos += max(gh, gw)
        used[kind] += 1
    for kind in (_IMAGE, _VIDEO):
        if used[kind] != len(queues[kind]):
            what, token = names[kind]
            raise PrefillError(f"input_ids: {used[kind]} {token} run(s) but {len(queues[kind])} {what} grid(s) given")
    llm = np.concatenate(pieces, axis=1)
    position_ids = np.zeros((3, ids.size), np.int64)
    position_ids[:, keep] = llm
    rope_delta = int(llm.max()) + 1 - int(kept.size)
    return position_ids, rope_delta


# --------------------------------------------------------------------------- payload


@dataclass
class PrefillPayload:
    """Everything a language-model prefill takes from the vision side, checked consistent.

    deepstack[k] = (k, features): added to the hidden states at `visual_positions` right
    after decoder layer k, for k = 0..K-1 (transformers' Qwen3VLTextModel)."""
    input_ids: np.ndarray          # [S] int64, image pads expanded
    visual_positions: np.ndarray   # [M] int64, indices of the <|image_pad|> (and <|video_pad|>) tokens, ascending
    image_embeds: np.ndarray       # [M, D]: main merger output of each visual position, in prompt order
    deepstack: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (decoder layer, [M, D])
    position_ids: np.ndarray = None  # [3, S] int64 (t, h, w)
    rope_delta: int = 0

    @property
    def deepstack_layers(self) -> np.ndarray:
        return np.array([k for k, _ in self.deepstack], np.int64)

    @property
    def deepstack_features(self) -> np.ndarray:
        """[K, M, D]; K may be 0."""
        if not self.deepstack:
            return np.zeros((0,) + self.image_embeds.shape, self.image_embeds.dtype)
        return np.stack([f for _, f in self.deepstack])


def _as_deepstack(deepstack_features, num_layers: int, embeds: np.ndarray) -> list[np.ndarray]:
    if not isinstance(num_layers, (int, np.integer)) or isinstance(num_layers, bool) or num_layers < 0:
        raise PrefillError(f"num_deepstack_layers = {num_layers!r}: expected a non-negative integer")
    if deepstack_features is None:
        feats = []
    elif isinstance(deepstack_features, np.ndarray):
        if deepstack_features.ndim != 3:
            raise PrefillError(f"deepstack_features: expected shape [K, M, D] or a list of [M, D], got "
                               f"{list(deepstack_features.shape)}")
        feats = list(deepstack_features)
    else:
        feats = list(deepstack_features)
    if len(feats) != num_layers:
        if num_layers and not feats:
            raise PrefillError(f"the config has {num_layers} DeepStack layer(s) but no deepstack features were given")
        raise PrefillError(f"the config has {num_layers} DeepStack layer(s) but {len(feats)} deepstack "
                           "feature(s) were given")
    out = []
    for k, f in enumerate(feats):
        if f is None:
            raise PrefillError(f"deepstack_features[{k}]: missing; the config has {num_layers} DeepStack layer(s) "
                               "and each needs its features")
        f = _as_features(f, f"deepstack_features[{k}]")
        if f.shape != embeds.shape:
            raise PrefillError(f"deepstack_features[{k}]: shape {list(f.shape)} differs from image_embeds "
                               f"{list(embeds.shape)}")
        out.append(f)
    return out


def _checked_rows(ids, pad: int, token: str, embeds, grids, merge_size: int, what: str, key: str):
    """The pad positions of one modality, checked against its rows and grids."""
    positions = np.flatnonzero(ids == pad).astype(np.int64)
    if positions.size != embeds.shape[0]:
        raise PrefillError(f"input_ids has {positions.size} {token} tokens but {key} has {embeds.shape[0]} rows")
    expected = sum(merged_count(g, merge_size) for g in grids)
    if expected != embeds.shape[0]:
        raise PrefillError(f"{'video_' if what == 'video' else ''}grid_thw gives {expected} merged tokens for "
                           f"{len(grids)} {what}(s) but {key} has {embeds.shape[0]} rows")
    return positions


def build_prefill_payload(input_ids, image_embeds, deepstack_features, grid_thw, num_deepstack_layers: int,
                          merge_size: int = 2, *, token_ids: TokenIds, video_embeds=None,
                          video_deepstack_features=None, video_grid_thw=None) -> PrefillPayload:
    """Check and bundle an expanded prompt with the vision outputs of its images and videos.

    input_ids [S] (pads already expanded, see `expand_image_pads`; a video's as
    Qwen3VLProcessor writes them, `runtime.inputs.tokenizer.video_placeholder`), image_embeds
    [M, D] (images concatenated in prompt order), deepstack_features [K, M, D] or a list
    of K [M, D] (None when K = 0), grid_thw [n, 3], num_deepstack_layers = K from the
    config (len(deepstack_visual_indexes)); for videos the same three as video_embeds,
    video_deepstack_features and video_grid_thw [v, 3] (T, h, w).

    With videos the payload's rows are the visual positions' (image and video pads) in
    prompt order: image rows at the image pads, video rows at the video pads, as
    transformers' two masked scatters and its joint DeepStack rows place them. The pad ids
    are the checkpoint's (`token_ids`). Raises PrefillError on any inconsistency."""
    ids = _as_ids(input_ids)
    image_pad, video_pad = token_ids.image_token_id, token_ids.video_token_id
    pad_ids = dict(image_token_id=image_pad, video_token_id=video_pad)
    grids = _as_grids(grid_thw, merge_size)
    embeds = _as_features(image_embeds, "image_embeds")
    image_positions = _checked_rows(ids, image_pad, "<|image_pad|>", embeds, grids, merge_size, "image",
                                    "image_embeds")
    feats = _as_deepstack(deepstack_features, num_deepstack_layers, embeds)
    if video_embeds is None:
        if (ids == video_pad).any():
            raise PrefillError(f"input_ids: <|video_pad|> at {int(np.flatnonzero(ids == video_pad)[0])} but no "
                               "video_embeds were given")
        position_ids, rope_delta = mrope_position_ids(ids, grids, merge_size, **pad_ids)  # checks each pad run
        return PrefillPayload(input_ids=ids, visual_positions=image_positions, image_embeds=embeds,
                              deepstack=list(enumerate(feats)), position_ids=position_ids, rope_delta=rope_delta)
    video_grids = _as_grids(video_grid_thw, merge_size, "video")
    video = _as_features(video_embeds, "video_embeds")
    if video.shape[1:] != embeds.shape[1:]:
        raise PrefillError(f"video_embeds: width {video.shape[1]} differs from image_embeds' {embeds.shape[1]}")
    video_positions = _checked_rows(ids, video_pad, "<|video_pad|>", video, video_grids, merge_size, "video",
                                    "video_embeds")
    video_feats = _as_deepstack(video_deepstack_features, num_deepstack_layers, video)
    visual_positions = np.sort(np.concatenate([image_positions, video_positions]))
    is_video = np.isin(visual_positions, video_positions)

    def joint(image_rows, video_rows):
        out = np.empty((visual_positions.size, embeds.shape[1]), np.result_type(image_rows, video_rows))
        out[~is_video], out[is_video] = image_rows, video_rows
        return out

    position_ids, rope_delta = mrope_position_ids(ids, grids, merge_size, video_grid_thw=video_grids, **pad_ids)
    return PrefillPayload(input_ids=ids, visual_positions=visual_positions, image_embeds=joint(embeds, video),
                          deepstack=[(k, joint(a, b)) for k, (a, b) in enumerate(zip(feats, video_feats))],
                          position_ids=position_ids, rope_delta=rope_delta)


def _check_hidden(x, payload: PrefillPayload, name: str) -> np.ndarray:
    x = np.asarray(x)
    s, d = payload.input_ids.size, payload.image_embeds.shape[1]
    if x.shape != (s, d):
        raise PrefillError(f"{name}: expected shape [{s}, {d}] (sequence, hidden), got {list(x.shape)}")
    return x


def scatter_image_embeds(inputs_embeds, payload: PrefillPayload) -> np.ndarray:
    """A copy of inputs_embeds [S, D] whose image-pad rows are the image embeds, in order
    (transformers: `inputs_embeds.masked_scatter(image_mask, image_embeds)`)."""
    x = _check_hidden(inputs_embeds, payload, "inputs_embeds")
    out = x.copy()
    out[payload.visual_positions] = payload.image_embeds.astype(out.dtype, copy=False)
    return out


def add_deepstack(hidden, payload: PrefillPayload, layer: int) -> np.ndarray:
    """Hidden states [S, D] after decoder layer `layer`: a copy with that layer's DeepStack
    feature added at the visual positions (transformers' `_deepstack_process`), or
    `hidden` itself, unchanged, when the layer has no feature."""
    x = _check_hidden(hidden, payload, "hidden")
    feats = [f for k, f in payload.deepstack if k == layer]
    if not feats:
        return hidden
    out = x.copy()
    out[payload.visual_positions] = out[payload.visual_positions] + feats[0].astype(out.dtype, copy=False)
    return out


# --------------------------------------------------------------------------- file


def save_payload(path, payload: PrefillPayload) -> None:
    """Write the payload as one safetensors file, atomically: a temp
    file beside `path`, fsync, os.replace; the temp is removed on any error. Keys:
    input_ids [S] i64, visual_positions [M] i64, image_embeds [M, D], deepstack_features
    [K, M, D], deepstack_layers [K] i64, position_ids [3, S] i64, rope_delta [] i64 (a scalar)."""
    from safetensors.numpy import save

    tensors = {
        "input_ids": payload.input_ids.astype(np.int64),
        "visual_positions": payload.visual_positions.astype(np.int64),
        "image_embeds": payload.image_embeds,
        "deepstack_features": payload.deepstack_features,
        "deepstack_layers": payload.deepstack_layers,
        "position_ids": payload.position_ids.astype(np.int64),
        "rope_delta": np.array(payload.rope_delta, np.int64),
    }
    data = save({k: np.require(v, requirements="C") for k, v in tensors.items()},  # keeps 0-d
                metadata={"format": PAYLOAD_FORMAT, "version": PAYLOAD_VERSION})
    write_atomic(path, data)


def load_payload(path) -> PrefillPayload:
    """Read a file `save_payload` wrote."""
    from safetensors.numpy import load_file

    data = load_file(str(path))
    missing = [k for k in PAYLOAD_KEYS if k not in data]
    if missing:
        raise PrefillError(f"{path}: not a prefill payload (missing {', '.join(missing)})")
    layers = data["deepstack_layers"].tolist()
    feats = data["deepstack_features"]
    if len(layers) != feats.shape[0]:
        raise PrefillError(f"{path}: {len(layers)} deepstack layers but {feats.shape[0]} deepstack features")
    return PrefillPayload(input_ids=data["input_ids"], visual_positions=data["visual_positions"],
                          image_embeds=data["image_embeds"], deepstack=[(int(k), f) for k, f in zip(layers, feats)],
                          position_ids=data["position_ids"], rope_delta=int(data["rope_delta"].reshape(-1)[0]))
