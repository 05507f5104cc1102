"""The language-model module whole: every entry of the text graph (emitter/text.py's
prefill, decode and reset; emitter/text_pool.py's pooling entries) over the same weight
globals, rendered as one MLIR module with its header."""

from __future__ import annotations

from . import __version__, quant
from .kv_pages import BLOCK
from .module import render
from .precision import Precision, for_graph
from .text import decode_function, prefill_function, reset_function
from .text_config import TextConfig
from .text_pool import pool_lane_counts, pool_lanes_function
from .text_shape import MODULE_NAME, TextShape, lane_counts


def emit_text_module(cfg: TextConfig, shape: TextShape, deepstack_layers: int, precision: Precision | str = "f32",
                     functions: str = "all") -> str:
    """MLIR text of the language-model module (deterministic: same input, same bytes):
    `prefill_<S>` for each bucket S, `decode_<B>` for each lane count B, and `reset`; a pooling
    shape's `pool_<S>` and `pool_<S>x<B>` (S each of its lane buckets) too (text_pool.py; `functions` "prefill" or
    "decode": only those, for benchmarks)."""
    precision = for_graph(precision)
    entries = []
    if functions in ("all", "prefill"):
        entries += [prefill_function(cfg, shape, s, deepstack_layers, precision) for s in shape.buckets]
        if shape.pooled:
            entries += [prefill_function(cfg, shape, s, deepstack_layers, precision, pooled=True)
                        for s in shape.buckets]
            entries += [pool_lanes_function(cfg, shape, s, n, deepstack_layers, precision)
                        for s in shape.lane_buckets for n in pool_lane_counts(shape)]
    if functions in ("all", "decode"):
        entries += [decode_function(cfg, shape, n, precision) for n in lane_counts(shape.lanes)]
    entries.append(reset_function(cfg, shape, precision))
    functions_, shared, weights = [], [], None
    for entry, globals_ in entries:  # the same weight globals; each its own kernel executables (q8_0)
        read = [g for g in globals_ if not g.startswith("stream.executable")]
        assert weights is None or read == weights, "every entry reads the same globals"
        functions_.append(entry)
        weights = read
        shared += [g for g in globals_ if g not in shared]
    kv = "" if shape.kv_dtype == "f32" else f" in {shape.kv_dtype}"
    header = (f"// Qwen3-VL language model, prompt buckets {', '.join(map(str, shape.buckets))}, context "
              f"{shape.context}, {shape.lanes} lanes, KV cache of {shape.blocks} blocks of {BLOCK}{kv}, "
              f"{deepstack_layers} DeepStack layers{precision.note}{native_note(cfg)}"
              f"{', last-token pooling entries' if shape.pooled else ''}.\n"
              f"// Emitted by qwen3vl-iree {__version__}; do not edit by hand.\n"
              f"// text config: {', '.join(f'{k}={v}' for k, v in cfg.to_dict().items() if k != 'native_weights')}\n")
    return render(MODULE_NAME, header, shared, functions_)


def native_note(cfg: TextConfig) -> str:
    """The module header's words for a checkpoint run in its own bits: how many weights at
    which bits, forms and groups (the per-weight list is in the weight schema)."""
    kinds = sorted({(l.bits, l.group, "affine" if l.affine else "symmetric")
                    for l in quant.native_layouts(cfg.native_weights).values()})
    if not kinds:
        return ""
    return (f", {len(cfg.native_weights)} weights in the checkpoint's own bits "
            f"({', '.join(f'{bits}-bit {form} groups of {group}' for bits, group, form in kinds)}), f32 matmuls")
