"""What a language model takes resident, and so how large its KV cache may be: the weights'
bytes (`weight_bytes`: the language model at its precision, the vision tower beside it), the
KV cache's bytes a token, its default share of the memory (`kv_memory`), and the default
context and pool size that follow (`default_context`, `kv_blocks`)."""

from __future__ import annotations

import os
from pathlib import Path

from emitter.experts import is_expert
from emitter.kv_pages import BLOCK
from emitter.precision import Precision, precision as precision_of
from emitter.targets import DEFAULT_TARGET
from emitter import quant
from emitter.text import EMBEDDING, text_weights, weight_shapes
from emitter.text_shape import TextShape, TextShapeError
from emitter.vision import graph_weights

from runtime.artifact.archive import spec_bytes
from runtime.artifact.build import vision_source
from runtime.checkpoints import gguf_text, gguf_vision
from runtime.checkpoints.text import model_text_config as load_text_config
from runtime.text import CONTEXT_LADDER, DEFAULT_CONTEXT, GenerateError, checkpoint_precision, text_precision


def step_bytes(cfg, precision) -> int:
    """Bytes of weights one token's decode step reads (`cfg`, `precision` as the graph is built:
    `text_precision`): every weight whole but the embedding table (a row a token, left out) and
    a sparse layer's expert stacks and their scales, of which it reads num_experts_per_tok of
    num_experts (emitter/experts.py: only the chosen experts' weights)."""
    owner = {}  # each graph weight's checkpoint weight: itself, or the one whose scales or biases it is
    for name, _ in weight_shapes(cfg):
        owner.update({name: name, quant.scales_name(name): name, quant.biases_name(name): name})
    total = 0
    for spec in text_weights(cfg, precision):
        weight = owner[spec.name]
        if weight.endswith(EMBEDDING):
            continue
        share = cfg.num_experts_per_tok / cfg.num_experts if is_expert(weight) else 1
        total += spec_bytes(spec) * share
    return int(total)


def available_memory() -> int:
    """Bytes of memory available now (MemAvailable of /proc/meminfo; free pages elsewhere)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_token_bytes(cfg, kv_dtype: str = "f32") -> int:
    """Bytes of KV cache one token takes, all layers, K and V."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * (2 if kv_dtype == "bf16" else 4)


def kv_memory(resident: int = 0) -> float:
    """Bytes the KV cache may take by default: half of the memory available now less
    `resident`, the bytes of the weights that will be loaded beside it (`weight_bytes`)."""
    return max(0, available_memory() - resident) * 0.5


def default_context(model_dir, kv_dtype: str = "f32", resident: int = 0) -> tuple[int, str]:
    """The context when `--context` is not given: the ladder's top (32768), at most the
    checkpoint's max_position_embeddings and what `kv_memory(resident)` holds for one
    sequence (a multiple of 512, at least 4096); and why."""
    cfg, _ = load_text_config(model_dir)
    fits = int(kv_memory(resident) // kv_token_bytes(cfg, kv_dtype)) // 512 * 512
    limits = [(CONTEXT_LADDER[-1], "the default ceiling"),
              (cfg.max_position_embeddings, "the model's max_position_embeddings"),
              (max(fits, DEFAULT_CONTEXT), "what half the memory the weights leave holds")]
    return min(limits)


def fitting_context(tokens: int, limit: int) -> int:
    """The least context of the ladder that holds `tokens`, at most `limit` (generate's)."""
    return next((c for c in CONTEXT_LADDER if c >= tokens and c <= limit), limit)


def kv_blocks(model_dir, buckets, context: int, lanes: int, kv_dtype: str = "f32",
              memory_gb: float | None = None, resident: int = 0) -> tuple[int, str]:
    """The KV pool's block count for `--kv-cache-memory` (GB), or by default a whole context
    for each of `lanes` sequences, at most `kv_memory(resident)` and at least one context;
    and a line saying what was chosen."""
    cfg, _ = load_text_config(model_dir)
    try:
        shape = TextShape(tuple(buckets), context, lanes, 0, kv_dtype)
    except TextShapeError as e:
        raise GenerateError(str(e)) from None
    block_bytes = kv_token_bytes(cfg, kv_dtype) * BLOCK
    least = shape.max_blocks + 1
    if memory_gb is not None:
        if not memory_gb > 0:
            raise GenerateError(f"--kv-cache-memory {memory_gb}: expected a positive number of GB")
        blocks = int(memory_gb * 1e9 // block_bytes)
        if blocks < least:
            raise GenerateError(f"--kv-cache-memory {memory_gb}: {blocks} blocks of {BLOCK} tokens, fewer than one "
                                f"context of {context} tokens needs ({least}, {least * block_bytes / 1e9:.3f} GB)")
        why = "--kv-cache-memory"
    else:
        blocks = max(least, min(shape.blocks, int(kv_memory(resident) // block_bytes)))
        why = ("a whole context per --max-batch sequence" if blocks == shape.blocks else
               f"half the memory the weights ({resident / 1e9:.2f} GB) leave")
    return blocks, (f"{blocks} blocks of {BLOCK} tokens ({blocks * block_bytes / 1e9:.2f} GB, {kv_dtype}; "
                    f"{(blocks - 1) * BLOCK} tokens in all, {why})")


def vision_parts(model_dir):
    """(vision config, image policy, video policy) of a checkpoint: a folder's, an mmproj's
    beside a GGUF text file (`gguf_vision.vision_parts`), or Nones for a GGUF text file alone
    (no vision tower)."""
    from emitter.config import load_model_config
    from emitter.policy import load_policy
    from emitter.video_policy import load_video_policy

    mmproj = gguf_vision.mmproj_file(model_dir)
    if mmproj:
        return gguf_vision.vision_parts(mmproj)
    if gguf_text.is_gguf(model_dir):
        return None, None, None
    cfg = load_model_config(model_dir)
    return cfg, load_policy(model_dir, cfg), load_video_policy(model_dir, cfg)


def weight_bytes(model_dir, precision: Precision | str | None, target: str | None = None, vision: bool = True) -> int:
    """Bytes the weights take resident once loaded: the language model's at `precision`
    (None: the checkpoint's own) and, with `vision`, the tower's beside it (at
    `Precision.tower`). What the KV cache's default size leaves them (`kv_memory`)."""
    precision = precision_of(precision) if precision else checkpoint_precision(model_dir)
    cfg, text = text_precision(model_dir, load_text_config(model_dir)[0], precision, target or DEFAULT_TARGET)
    total = sum(map(spec_bytes, text_weights(cfg, text)))
    if vision and vision_parts(model_dir)[0] is not None:
        tower_cfg, _, tower, *_ = vision_source(str(model_dir), None, precision.tower)
        total += sum(map(spec_bytes, graph_weights(tower_cfg, tower)))
    return total
