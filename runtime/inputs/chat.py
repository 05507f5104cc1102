"""A chat's prompt for the language model: messages with images and videos in; token ids,
M-RoPE positions and the visual rows (embeddings and DeepStack features) out.

`messages` are as the chat template takes them: {"role", "content"}, the content a string
or a list of parts {"type": "text", "text"}, {"type": "image"}, {"type": "video"}. The
media (`Media`, in their order of appearance in the rendered prompt) are processed one by
one (`process_media`); their rows are encoded either all in one tower call
(`encode_joint`, what `qwen3vl generate` does) or by any callable with the same contract
(the server's encoder cache), and placed at the pad tokens in prompt order
(`build_prompt`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from runtime.inputs.packing import patch_count
from runtime.inputs.prefill import mrope_position_ids
from runtime.inputs.processor import image_grid, process_image
from runtime.inputs.video import frame_grids, process_video, prompt_groups


@dataclass(frozen=True)
class Media:
    kind: str  # "image" or "video"
    source: object  # a path (or a PIL image for "image")
    name: str | None = None  # what error messages call it
    policy: object = None  # an image's own ProcessorPolicy (a request's budget); None: the checkpoint's


@dataclass
class ProcessedMedia:
    kind: str
    pixels: np.ndarray  # [patches, patch_dim] f32
    grid: tuple[int, int, int]  # (t, h, w); a video's t counts temporal groups
    inputs: list[tuple[int, int, int]]  # the tower's inputs: the image, or each temporal group
    prompt: object  # an image's merged-token count; a video's (group timestamps, tokens per group)
    source: Media | None = None

    @property
    def patches(self) -> int:
        return max(patch_count(g) for g in self.inputs)


@dataclass
class Prompt:
    ids: np.ndarray  # [n] int64, pads expanded
    positions: np.ndarray  # [3, n] M-RoPE ids
    rope_delta: int
    visual: np.ndarray | None = None  # [M] rows of `ids` that are pads
    embeds: np.ndarray | None = None  # [M, D]
    deepstack: np.ndarray | None = None  # [K, M, D]
    seconds: dict[str, float] = field(default_factory=dict)


def process_media(items, policy, video_policy, merge_unit: int) -> list[ProcessedMedia]:
    """Each image or video decoded and processed as transformers' processors do."""
    out = []
    for item in items:
        if item.kind == "image":
            pixels, grid = process_image(item.source, item.policy or policy, name=item.name)
            out.append(ProcessedMedia("image", pixels, grid, [grid], patch_count(grid) // merge_unit, item))
        elif item.kind == "video":
            pixels, grid, decoded = process_video(item.source, video_policy, item.name)
            out.append(ProcessedMedia("video", pixels, tuple(int(v) for v in grid), frame_grids([grid]),
                                      prompt_groups(decoded, grid, video_policy), item))
        else:
            raise ValueError(f"media kind {item.kind!r}: expected 'image' or 'video'")
    return out


def image_tokens(items, policy, merge_unit: int) -> int:
    """The prompt tokens the images among `items` will take, from their headers alone
    (nothing decoded): a too-large image is refused before it costs its decoding."""
    return sum(patch_count(image_grid(m.source, m.policy or policy, m.name)) // merge_unit
               for m in items if m.kind == "image")


Rows = tuple[np.ndarray, np.ndarray]  # embeds [m, D], deepstack [K, m, D] of one medium


def encode_joint(session: Callable, processed: list[ProcessedMedia]) -> list[Rows]:
    """All media in one packed tower run (`session()` gives the vision session, which takes
    any size); the rows split back per medium."""
    inputs = [g for m in processed for g in m.inputs]
    vision = session()
    out = vision.encode_pixels(np.concatenate([m.pixels for m in processed]), inputs)
    merge_unit = vision.cfg.spatial_merge_size ** 2
    bounds = np.cumsum([0] + [sum(patch_count(g) for g in m.inputs) // merge_unit for m in processed])
    return [(out.image_embeds[a:b], out.deepstack_features[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def prompt_ids(tokenizer, token_ids, messages, processed: list[ProcessedMedia],
               template_kwargs: dict | None = None) -> np.ndarray:
    """The chat's token ids, each medium's pads expanded (`template_kwargs`: the template's
    other variables, `tools` and the like)."""
    images = [m.prompt for m in processed if m.kind == "image"]
    videos = [m.prompt for m in processed if m.kind == "video"]
    return tokenizer.messages_ids(messages, token_ids, images, videos, template_kwargs)


def build_prompt(ids: np.ndarray, token_ids, merge_size: int, processed: list[ProcessedMedia],
                 rows: list[Rows] | None) -> Prompt:
    """Positions and visual rows for `ids` (media in prompt order, `rows` theirs)."""
    image_id, video_id = token_ids.image_token_id, token_ids.video_token_id
    grids = np.array([m.grid for m in processed if m.kind == "image"], np.int64).reshape(-1, 3)
    video_grids = np.array([m.grid for m in processed if m.kind == "video"], np.int64).reshape(-1, 3)
    positions, delta = mrope_position_ids(ids, grids, merge_size, image_token_id=image_id,
                                          video_token_id=video_id, video_grid_thw=video_grids)
    prompt = Prompt(ids, positions, int(delta))
    if processed:
        prompt.visual = np.flatnonzero(np.isin(ids, (image_id, video_id)))
        prompt.embeds = np.concatenate([r[0] for r in rows])
        prompt.deepstack = np.concatenate([r[1] for r in rows], axis=1)
    return prompt


def media_in_order(messages) -> list[str]:
    """The kinds of the media parts of `messages`, in order ("image" / "video")."""
    kinds = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            kinds += [part["type"] for part in content if part.get("type") in ("image", "video")]
    return kinds
