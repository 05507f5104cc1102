"""The language model module's shape and entry points, what its runtime calls it by: the
function names, the prompt buckets, context, decode lanes and KV pool (`TextShape`), and how
a prompt is cut into chunks (`prefill_chunks`). The graph itself: emitter/text.py."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .kv_pages import BLOCK

MODULE_NAME = "qwen3vl_text"
PREFILL, DECODE, RESET, POOL = "prefill", "decode", "reset", "pool"
KV_DTYPES = ("f32", "bf16")
LANE_ROWS = 32  # the least rows of a lane in a batched pooling call: a 16-row bucket is a tail only
KV_CACHE_HELP = ("KV cache element type: bf16 halves the cache's memory, its keys and values rounded to bf16 "
                 "(docs/text.md gives the distance from f32).")


class TextShapeError(ValueError):
    """A prompt bucket, context, lane or block count the graph cannot be built for."""


def check_kv_dtype(kv_dtype: str) -> str:
    if kv_dtype not in KV_DTYPES:
        raise TextShapeError(f"--kv-cache-dtype {kv_dtype!r}: expected one of {', '.join(KV_DTYPES)}")
    return kv_dtype


def _count(value, what: str, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise TextShapeError(f"{what} {value!r}: expected an integer of at least {least}")
    return value


def lane_counts(lanes: int) -> list[int]:
    """The decode entries a module of `lanes` lanes has: 1, 2, 4, ... below `lanes`, and `lanes`."""
    return [1 << i for i in range(lanes.bit_length()) if 1 << i < lanes] + [lanes]


@dataclass(frozen=True)
class TextShape:
    """What the module's shapes depend on beside the model: the prompt buckets (multiples
    of BLOCK; the largest is the chunk C), the context, the decode lanes, the KV pool's
    blocks and its element type; `pooled`: the module also has `pool_<S>` entries (an
    embedding model's last-token rows)."""
    buckets: tuple[int, ...]
    context: int
    lanes: int = 1
    blocks: int = 0  # 0: one context's blocks per lane, and block 0
    kv_dtype: str = "f32"
    pooled: bool = False

    def __post_init__(self):
        _count(self.context, "--context")
        buckets = []
        for bucket in self.buckets:
            if isinstance(bucket, bool) or not isinstance(bucket, int) or not 0 < bucket <= self.context \
                    or bucket % BLOCK:
                raise TextShapeError(f"prompt bucket {bucket!r}: expected a positive multiple of {BLOCK} (the KV "
                                     f"cache's block) <= the context {self.context}")
            if bucket not in buckets:
                buckets.append(bucket)
        if not buckets:
            raise TextShapeError("prompt buckets: expected at least one")
        object.__setattr__(self, "buckets", tuple(sorted(buckets)))
        _count(self.lanes, "--max-batch")
        check_kv_dtype(self.kv_dtype)
        if not self.blocks:
            object.__setattr__(self, "blocks", self.lanes * self.max_blocks + 1)
        if _count(self.blocks, "KV cache blocks", 2) < self.max_blocks + 1:
            raise TextShapeError(f"KV cache of {self.blocks} blocks: expected at least {self.max_blocks + 1} (one "
                                 f"context of {self.context} tokens in blocks of {BLOCK}, and block 0)")

    @property
    def slots(self) -> int:
        """A sequence's slots: the context rounded up to a whole chunk, so that a prompt's
        last chunk from slot 0, padded, is inside them."""
        chunk = self.buckets[-1]
        return -(-self.context // chunk) * chunk

    @property
    def max_blocks(self) -> int:
        return self.slots // BLOCK

    @property
    def lane_bucket(self) -> int:
        """The bucket of a pooling module's lane-batched entries `pool_<S>x<B>`: the smallest
        of at least LANE_ROWS rows (a smaller one is a tail for `prefill_chunks`), else the largest."""
        return next((b for b in self.buckets if b >= LANE_ROWS), self.buckets[-1])

    @property
    def lane_buckets(self) -> tuple[int, ...]:
        """The buckets of the lane-batched entries: the lane bucket and those below it (its
        tails), so that items whose rests are planned alike share each chunk's call."""
        return tuple(b for b in self.buckets if b <= self.lane_bucket)


def prefill_name(bucket: int) -> str:
    return f"{PREFILL}_{bucket}"


def pool_name(bucket: int) -> str:
    return f"{POOL}_{bucket}"


def decode_name(lanes: int) -> str:
    return f"{DECODE}_{lanes}"


def decode_blocks(slots) -> int:
    """The table entries a decode step reads: the fewest blocks that hold every lane's slot
    (its own K/V is written there)."""
    return max(slots) // BLOCK + 1


@dataclass(frozen=True)
class Chunk:
    start: int  # its first slot (= text position)
    size: int  # the bucket (real rows: min(size, n - start))

    @property
    def name(self) -> str:
        return prefill_name(self.size)

    @property
    def blocks(self) -> int:
        """The table entries its call reads: the blocks of slots 0..start+size-1."""
        return (self.start + self.size) // BLOCK


# What one more call costs beside its rows, in rows: every call reads the weights whole once
# (2B f32: 6.9 GB, at 25-30 GB/s about what 16 rows' matmuls take at the FMA peak).
CALL_ROWS = BLOCK


def prefill_chunks(n: int, shape: TextShape, start: int = 0) -> list[Chunk] | None:
    """The calls that prefill slots start..n-1 of a prompt of n tokens (slots before
    `start` already cached; a multiple of BLOCK), attending over its sequence's slots up to
    each one's end: the buckets that cover the rest at the least rows, each call counted
    CALL_ROWS more (`chunk_plan`), largest first. None if the last one would end past the
    sequence's slots (only a `start` that is not a multiple of the largest bucket can do that)."""
    chunks = []
    for size in chunk_plan(-(-(n - start) // BLOCK), shape.buckets):
        chunks.append(Chunk(start, size))
        start += size
    return None if chunks and start > shape.slots else chunks


@lru_cache(maxsize=4096)
def chunk_plan(blocks: int, buckets: tuple[int, ...]) -> tuple[int, ...]:
    """The buckets (largest first) whose rows hold `blocks` blocks at the least cost, a
    call's cost its rows and CALL_ROWS: 78 rows (5 blocks) over buckets 16, 64, 128 are
    64 + 16, not 128; 300 over 128, 512 are 3 x 128, not 512."""
    costs, firsts = [0], [0]  # for b blocks: the least cost, and the first call's bucket of a plan at it
    for b in range(1, blocks + 1):
        # ties: the larger first call
        cost, first = min((size + CALL_ROWS + costs[max(0, b - size // BLOCK)], -size) for size in buckets)
        costs.append(cost)
        firsts.append(-first)
    plan = []
    while blocks > 0:
        plan.append(firsts[blocks])
        blocks -= firsts[blocks] // BLOCK
    return tuple(sorted(plan, reverse=True))
