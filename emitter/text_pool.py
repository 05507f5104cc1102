"""An embedding model's batched entry (a pooling module, `TextShape.pooled`, emitter/text.py):
`pool_<S>x<B>`, B sequences' prompts, each one chunk of S tokens at its own slot, prefilled in
one call and pooled, so that a server's embedding requests share the weights' reads as its
decode steps do.

pool_<S>x<B> (B lanes; each lane prefill_<S>'s arguments, stacked):
  tokens [B, S] i32, visual [B, S] i32, visual_embeds [B, S, D] f32, deepstack [K, B, S, D] f32
  (absent when K = 0), positions [3, B, S] i32, last [B] i32, starts [B] i32 (multiples of
  BLOCK), tables [B, N] i32 (each lane's sequence's first N blocks; distinct sequences, or a
  lane repeating another's inputs whole)
  -> hidden [B, D] f32: each lane's final normed hidden state of its token `last`; each lane's
  K and V written as prefill_<S> writes them. Every weight matmul runs once for the B x S
  rows; attention is per lane, over its own sequence (`TextGraph.attend_lanes`).
"""

from __future__ import annotations

from .builder import Value
from .kv_pages import SPAN, SPAN_BLOCKS
from .module import function
from .precision import Precision, for_graph
from .text_config import TextConfig
from .text_shape import POOL, TextShape, lane_counts


def pool_lanes_name(bucket: int, lanes: int) -> str:
    return f"{POOL}_{bucket}x{lanes}"


def pool_lane_counts(shape: TextShape) -> list[int]:
    """The lane counts of a pooling module's batched entries (its lane bucket's: the short
    items that gain from sharing a call): 2, 4, ... up to its lanes."""
    return [n for n in lane_counts(shape.lanes) if n > 1]


def pool_lanes_inputs(cfg: TextConfig, bucket: int, lanes: int, deepstack_layers: int) -> list[tuple]:
    d = cfg.hidden_size
    deepstack = [("deepstack", (deepstack_layers, lanes, bucket, d), "f32")] if deepstack_layers else []
    return [("tokens", (lanes, bucket), "i32"), ("visual", (lanes, bucket), "i32"),
            ("visual_embeds", (lanes, bucket, d), "f32"), *deepstack, ("positions", (3, lanes, bucket), "i32"),
            ("last", (lanes,), "i32"), ("starts", (lanes,), "i32"), ("tables", (lanes, SPAN_BLOCKS), "i32")]


def pool_lanes_function(cfg: TextConfig, shape: TextShape, bucket: int, lanes: int, deepstack_layers: int,
                        precision: Precision | str = "f32") -> tuple[dict, list]:
    """pool_<bucket>x<lanes>: see the module docstring."""
    from .text import TextGraph, position_mask

    g = TextGraph(cfg, shape, for_graph(precision))
    b = g.b
    inputs = {name: g.argument(name, dims, dtype)
              for name, dims, dtype in pool_lanes_inputs(cfg, bucket, lanes, deepstack_layers)}
    b.bind(SPAN_BLOCKS.base, b.dimension_size(inputs["tables"], 1, hint="span_blocks"))
    d, rows = cfg.hidden_size, lanes * bucket

    def flat(name: str, shape_: tuple) -> Value:
        return b.reshape(inputs[name], shape_, hint=name)

    def scalar(name: str, i: int) -> Value:
        return b.reshape(b.slice(inputs[name], (i,), (i + 1,)), (), hint=name[:-1] if name.endswith("s") else name)

    starts = [scalar("starts", i) for i in range(lanes)]
    tables = [b.reshape(b.slice(inputs["tables"], (i, 0), (i + 1, SPAN_BLOCKS)), (SPAN_BLOCKS,), hint="table")
              for i in range(lanes)]
    with b.stage("embed"):
        tokens = flat("tokens", (rows,))
        visual = b.compare("NE", flat("visual", (rows,)), b.constant(0, (rows,), "i32"), hint="visual")
        visual = b.broadcast_in_dim(visual, (rows, d), [0], hint="visual")
        x = b.select(visual, flat("visual_embeds", (rows, d)), g.embed(tokens), hint="inputs_embeds")

    def deepstack(n, x):
        if n >= deepstack_layers:
            return x
        with b.stage(f"deepstack.{n}"):
            feature = b.reshape(b.slice(inputs["deepstack"], (n, 0, 0, 0), (n + 1, lanes, bucket, d)), (rows, d))
            return b.add(x, feature, hint="deepstack")

    def lane(value: Value, i: int, axis: int) -> Value:
        start, limit = [0] * value.rank, list(value.shape)
        start[axis], limit[axis] = i * bucket, (i + 1) * bucket
        return b.slice(value, tuple(start), tuple(limit), hint="lane")

    def attend(n, q, k, v, masks):
        contexts = g.attend_lanes(n, [(lane(q, i, 0), lane(k, i, 1), lane(v, i, 1), tables[i], starts[i], masks[i])
                                      for i in range(lanes)])
        return b.concatenate(contexts, 0, hint="context")

    masks = lambda: [position_mask(b, start, bucket, SPAN) for start in starts]  # noqa: E731
    x = g.decoder(x, flat("positions", (3, rows)), masks, attend, deepstack)
    with b.stage("last"):
        picked = []
        for i in range(lanes):
            row = b.add(scalar("last", i), b.constant(i * bucket, (), "i32", hint="lane_row"), hint="row")
            picked.append(b.dynamic_slice(x, [row, g.zero], (1, d), hint="last"))
        last = b.concatenate(picked, 0, hint="last")
    return function(b, pool_lanes_name(bucket, lanes), [("hidden", g.pooled(last))]), b.globals
