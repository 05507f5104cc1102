"""Embedding models (Qwen3-VL-Embedding): how a checkpoint says it is one, the chat it embeds,
and the vector it gives. The language model's `pool_<S>` entries (emitter/text.py) return the
final normed hidden state of a prompt's last token; here it becomes the retrieval vector.

- `checkpoint_pooling(model_dir)`: sentence-transformers' files, read as vLLM reads them:
  modules.json names a `Pooling` module whose config.json has `pooling_mode_lasttoken` true;
  the vector is normalized when modules.json has a `Normalize` module. Without them, the
  model card (README.md's front matter) of Qwen3-VL-Embedding: a tag naming embedding, or
  `pipeline_tag: feature-extraction` (last-token pooling, normalized, as the card's embedder).
- `resolve_pooling`: that, or what `--pooling last` / `--normalize` say.
- `item_messages`: Qwen3-VL-Embedding's format (its model card's embedder): the instruction
  as the system message (default "Represent the user's input.", ending in punctuation), the
  user turn's parts (images, videos, text; "NULL" when it has none), and the generation
  prompt; the vector is the last token's.
- `finish`: Matryoshka `dimensions` (the first N values), then L2 normalization.
- `embed(gen, messages, media)`: one item's vector through a `Generator` opened with pooling.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.checkpoints.model_card import card_names

POOLING_CHOICES = ("last",)
DEFAULT_INSTRUCTION = "Represent the user's input."
ST_POOLING = "sentence_transformers.models.Pooling"
ST_MODULES = ("sentence_transformers.models.Transformer", ST_POOLING, "sentence_transformers.models.Normalize")


class PoolingError(ValueError):
    """A pooling the checkpoint or the options ask for that this runtime cannot give; one line."""


@dataclass(frozen=True)
class Pooling:
    kind: str = "last"  # last-token pooling of the final normed hidden state
    normalize: bool = True  # L2, after any Matryoshka truncation
    source: str = "--pooling"  # what said so: the option, or the checkpoint's files

    def describe(self) -> str:
        return f"{self.kind}-token pooling{', normalized' if self.normalize else ''} ({self.source})"


def checkpoint_pooling(model_dir) -> Pooling | None:
    """The pooling sentence-transformers' files in `model_dir` declare (modules.json and its
    Pooling module's config.json), or None when there are none (a generative checkpoint)."""
    folder = Path(model_dir)
    path = folder / "modules.json"
    if not folder.is_dir():
        return None
    if not path.is_file():
        return Pooling("last", True, "checkpoint's README.md") if card_says_embedding(folder) else None
    try:
        modules = json.loads(path.read_text())
        kinds = [m["type"] for m in modules]
        pooling = next(m for m in modules if m["type"] == ST_POOLING)
        config = json.loads((folder / pooling.get("path", "1_Pooling") / "config.json").read_text())
    except StopIteration:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PoolingError(f"{path}: cannot read sentence-transformers' modules ({type(e).__name__}: {e})") from None
    other = [k for k in kinds if k not in ST_MODULES]
    if other:
        raise PoolingError(f"{path}: module {other[0]}: only Transformer, Pooling and Normalize are supported")
    modes = sorted(k.removeprefix("pooling_mode_") for k, v in config.items() if k.startswith("pooling_mode_") and v)
    if modes != ["lasttoken"]:
        raise PoolingError(f"{path}: pooling {'+'.join(modes) or 'none'}: only last-token pooling "
                           "(pooling_mode_lasttoken) is supported")
    return Pooling("last", "sentence_transformers.models.Normalize" in kinds, "checkpoint's modules.json")


def card_says_embedding(folder: Path) -> bool:
    """Whether README.md's front matter (the Hugging Face model card) names an embedding model:
    `pipeline_tag: feature-extraction`, or a tag naming embedding (Qwen3-VL-Embedding's card
    has both), and no rerank tag."""
    return (card_names(folder, "feature-extraction", "embedding")
            and not card_names(folder, "text-ranking", "rerank"))


def resolve_pooling(model_dir, pooling: str | None = None, normalize: bool | None = None) -> Pooling | None:
    """The embedding pooling to open `model_dir` with: `pooling` ("last") as asked, else the
    checkpoint's (`checkpoint_pooling`), else None (generative). `normalize` None: the
    checkpoint's Normalize module where it has files, else true (vLLM's default)."""
    if pooling is not None and pooling not in POOLING_CHOICES:
        raise PoolingError(f"--pooling {pooling}: expected one of {', '.join(POOLING_CHOICES)}")
    found = checkpoint_pooling(model_dir)
    if found is None and pooling is None:
        if normalize is not None:
            raise PoolingError("--normalize/--no-normalize: only with --pooling (or an embedding checkpoint)")
        return None
    if found is None:
        found = Pooling(pooling, True, "--pooling")
    return Pooling(found.kind, found.normalize if normalize is None else normalize, found.source)


def headless(model_dir, cfg):
    """The text config an embedding model is opened with: `cfg`, or, for a checkpoint stored
    without lm_head and untied (an embedding model's needs none: Qwen3VLModel has no head), as
    if tied, so that the module's chat entries read the embedding table (their logits mean
    nothing there; the pooled rows never read the head)."""
    from dataclasses import replace

    from emitter.text_config import LM_HEAD
    from runtime.checkpoints import gguf_text
    from runtime.checkpoints.text import LAYOUTS, scan_text_tensors

    if cfg.tie_word_embeddings or gguf_text.is_gguf(model_dir):
        return cfg
    found, _ = scan_text_tensors(Path(model_dir))
    if any(head in found for _, head in LAYOUTS) or LM_HEAD in found:
        return cfg
    return replace(cfg, tie_word_embeddings=True)


def instruction_text(instruction: str | None) -> str:
    """The system message: `instruction` stripped, a full stop added unless it ends in
    punctuation (as the model card's embedder does); the default when empty."""
    text = (instruction or "").strip()
    if not text:
        return DEFAULT_INSTRUCTION
    return text if unicodedata.category(text[-1]).startswith("P") else text + "."


def item_messages(parts: list[dict], instruction: str | None = None) -> list[dict]:
    """One item as Qwen3-VL-Embedding embeds it: the instruction as the system message, the
    user turn's `parts` ({"type": "image"}, {"type": "video"}, {"type": "text", "text"}) or
    "NULL" when there are none (empty texts dropped)."""
    parts = [p for p in parts if p.get("type") != "text" or p.get("text")]
    return [{"role": "system", "content": [{"type": "text", "text": instruction_text(instruction)}]},
            {"role": "user", "content": parts or [{"type": "text", "text": "NULL"}]}]


def with_instruction(messages: list[dict], instruction: str | None = None) -> list[dict]:
    """A chat (vLLM's `messages` form) with the instruction as its system message when it has
    none, so that a plain user turn embeds as `item_messages` of its parts."""
    if messages and messages[0].get("role") == "system":
        return messages
    return [{"role": "system", "content": [{"type": "text", "text": instruction_text(instruction)}]}, *messages]


def finish(hidden, normalize: bool = True, dimensions: int | None = None) -> np.ndarray:
    """The retrieval vector of a pooled hidden state [D]: its first `dimensions` values
    (Matryoshka), then divided by its L2 norm (torch's F.normalize: at least 1e-12) when
    `normalize`."""
    v = np.asarray(hidden, np.float32).reshape(-1)
    if dimensions is not None:
        v = v[:dimensions]
    if normalize:
        v = (v.astype(np.float64) / max(float(np.linalg.norm(v.astype(np.float64))), 1e-12)).astype(np.float32)
    return v


def check_dimensions(dimensions, hidden: int, name: str = "dimensions") -> int | None:
    """`dimensions` None, or an integer in [1, hidden]; ValueError naming `name` otherwise."""
    if dimensions is None:
        return None
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= hidden:
        raise PoolingError(f"{name} {dimensions!r}: expected an integer in [1, {hidden}] (the model's hidden size)")
    return dimensions


def embed(gen, messages: list[dict], media=(), dimensions: int | None = None, encode=None) -> tuple[np.ndarray, int]:
    """(vector, prompt tokens) of one chat through `gen` (a Generator opened with pooling):
    rendered with the generation prompt, its media encoded, pooled, finished."""
    if gen.pooling is None:
        raise PoolingError("this model was opened without pooling: an embedding checkpoint, or --pooling last")
    check_dimensions(dimensions, gen.text.cfg.hidden_size)
    prompt = gen.prepare(messages, list(media), 1, encode=encode)
    return finish(gen.text.pooled_row(prompt), gen.pooling.normalize, dimensions), int(prompt.ids.size)


def lane_plan(text, prompt, start: int) -> tuple[int, ...] | None:
    """The chunk sizes that prefill `prompt`'s slots from `start` (`prefill_chunks`) when each
    is a lane bucket (`TextShape.lane_buckets`), so that the batched entries `pool_<S>x<B>`
    (emitter/text_pool.py) take them; None otherwise. Prompts of one plan share its calls."""
    from emitter.text_shape import prefill_chunks

    if not text.shape.pooled:
        return None
    chunks = prefill_chunks(int(prompt.ids.size), text.shape, start)
    if not chunks or any(c.size not in text.shape.lane_buckets for c in chunks):
        return None
    return tuple(c.size for c in chunks)


def lane_groups(items: list, counts: list[int]) -> list[list]:
    """`items` in calls of exactly the batched entries' lane counts (`counts`: 2, 4, ...), the
    largest first; what is left over (one item) goes alone. No lane repeats another: an
    item costs its tokens' work however it is batched, so a spare lane would be work for
    nothing (three items: a call of 2 and one alone, not a call of 4)."""
    groups = []
    while n := max((c for c in counts if c <= len(items)), default=0):
        groups.append(items[:n])
        items = items[n:]
    return groups


def pooled_rows(text, seqs, prompts, starts) -> np.ndarray:
    """The final normed hidden states [n, D] of n prompts' last tokens, each with a `lane_plan`
    in the block table `seqs[i]` from slot `starts[i]`. Step by step (every prompt's first
    chunk, then the second of those that have one, ...), the step's chunks of one size run
    in calls of exactly B of them (`pool_<S>x<B>`, `lane_groups`), one left over alone
    (`pool_<S>`); a prompt's row is its last chunk's. Their full blocks then keyed for the
    prefix cache, as `TextSession.prefill_blocks` keys them."""
    from emitter.text_pool import pool_lane_counts
    from runtime.outputs import check_finite

    plans = [lane_plan(text, p, s) for p, s in zip(prompts, starts)]
    if None in plans:
        raise ValueError("pooled_rows: expected prompts whose chunks are all lane buckets (lane_plan)")
    ids = [np.asarray(prompt.ids, np.int64).reshape(-1) for prompt in prompts]
    for one in ids:
        text._check_ids(one)
    hidden = np.zeros((len(seqs), text.cfg.hidden_size), np.float32)
    slots = list(starts)
    for step in range(max(map(len, plans))):
        sizes: dict[int, list[int]] = {}
        for i, plan in enumerate(plans):
            if step < len(plan):
                sizes.setdefault(plan[step], []).append(i)
        for bucket, members in sizes.items():
            groups = lane_groups(members, pool_lane_counts(text.shape))
            for group in groups + [[i] for i in members[sum(map(len, groups)):]]:
                hidden[group] = _chunk_call(text, bucket, [(seqs[i], slots[i], ids[i], prompts[i]) for i in group])
            for i in members:
                slots[i] += bucket
    check_finite("hidden state", hidden, "the language model")
    for seq in seqs:
        text.pool.remember(seq.ids[seq.keyed:len(seq.keys)], seq.keys[seq.keyed:])
    return hidden


def _chunk_call(text, bucket: int, lanes: list[tuple]) -> np.ndarray:
    """One call for chunks of `bucket` rows, one a lane ((sequence, first slot, ids, prompt)):
    `pool_<S>` for one, else the smallest `pool_<S>x<B>` that holds them (spare lanes repeat
    lane 0 whole). The lanes' final normed hidden states of their chunks' last tokens [n, D]."""
    from emitter.text_pool import pool_lane_counts, pool_lanes_inputs, pool_lanes_name
    from emitter.text_shape import Chunk, pool_name
    from runtime.artifact.iree_module import invoke

    chunks = [Chunk(slot, bucket) for _, slot, _, _ in lanes]
    per_lane = [text.prefill_arguments(chunk, ids, p.positions, p.visual, p.embeds, p.deepstack)
                for chunk, (_, _, ids, p) in zip(chunks, lanes)]
    if len(lanes) == 1:
        result = invoke(text.module[pool_name(bucket)], *per_lane[0], np.array(chunks[0].start, np.int32),
                        text.pool.table(lanes[0][0], chunks[0].blocks))
        return np.array(result.to_host(), dtype=np.float32, copy=True).reshape(1, -1)
    n = len(lanes)
    width = next(b for b in pool_lane_counts(text.shape) if b >= n)
    order = list(range(n)) + [0] * (width - n)
    blocks = max(chunk.blocks for chunk in chunks)
    names = [name for name, _, _ in pool_lanes_inputs(text.cfg, bucket, width, text.deepstack_layers)]
    axes = {"deepstack": 1, "positions": 1}
    args = [np.ascontiguousarray(np.stack([per_lane[k][i] for k in order], axis=axes.get(name, 0)))
            for i, name in enumerate(names[:-2])]
    starts = np.array([chunks[k].start for k in order], np.int32)
    tables = np.stack([text.pool.table(lanes[k][0], blocks) for k in order])
    result = invoke(text.module[pool_lanes_name(bucket, width)], *args, starts, tables)
    return np.array(result.to_host(), dtype=np.float32, copy=True).reshape(width, -1)[:n]
