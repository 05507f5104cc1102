"""The paged KV cache: its layout, and the reads and writes through a block table.

Every layer's K (and V) cache is one pool of fixed-size blocks shared by all sequences,
`[kv_heads, blocks, BLOCK, head_dim]`, a mutable module global that stays on the device.
A sequence's block table [max_blocks] i32 names the block that holds each BLOCK slots of
it: slot s lives at block table[s // BLOCK], row s % BLOCK. The runtime owns the blocks
(runtime/kv_cache.py); block 0 is never given out: a table's unused entries name it, and
the padded rows of a chunk are written there.

- `read_blocks` gathers the slots of a table's blocks, `[kv_heads, N, BLOCK, head_dim]`
  for a table of N entries (`read_span`: as `[kv_heads, N x BLOCK, head_dim]`); N may be
  a run-time dim (`SPAN_BLOCKS`): a call reads as many blocks as its caller passes;
- `write_chunk` writes a chunk's K/V (its start and length whole blocks) block by block;
- `write_token` updates one slot.
"""

from __future__ import annotations

from .builder import Builder, Value
from .dims import Dim

BLOCK = 16  # slots a block holds (vLLM's default block size)
SPAN_BLOCKS = Dim("blocks")  # the block-table entries a call reads, known at run time
SPAN = SPAN_BLOCKS * BLOCK  # the slots those blocks hold


def pool_shape(kv_heads: int, blocks: int, head_dim: int) -> tuple[int, int, int, int]:
    return (kv_heads, blocks, BLOCK, head_dim)


def table_entries(b: Builder, table: Value, first: Value | int, count: int, hint: str) -> Value:
    """table[first:first + count], [count] i32 (`first` a traced i32 or a constant)."""
    if isinstance(first, int):
        return b.slice(table, (first,), (first + count,), hint=hint)
    return b.dynamic_slice(table, [first], (count,), hint=hint)


def read_blocks(b: Builder, pool: Value, table: Value) -> Value:
    """The slots of the blocks `table` [N] names, in order, by block: [kv_heads, N, BLOCK,
    head_dim] (N an int or a run-time Dim)."""
    kv_heads, blocks, _, head_dim = pool.shape
    (count,) = table.shape
    rows = b.reshape(pool, (kv_heads * blocks, BLOCK * head_dim), hint="pool_rows")  # a view: row h * blocks + i
    head_rows = b.multiply(b.iota((kv_heads,), 0, "i32", hint="head"), b.constant(blocks, (kv_heads,), "i32",
                                                                                   hint="blocks"), hint="head_rows")
    rows_of = b.add(b.broadcast_in_dim(head_rows, (kv_heads, count), [0], hint="head_rows"),
                    b.broadcast_in_dim(table, (kv_heads, count), [1], hint="span_blocks"), hint="span_rows")
    taken = b.take_rows(rows, rows_of, hint="span")
    return b.reshape(taken, (kv_heads, count, BLOCK, head_dim), hint="span")


def read_span(b: Builder, pool: Value, table: Value) -> Value:
    """The slots of the blocks `table` [N] names, in order: [kv_heads, N x BLOCK, head_dim]."""
    kv_heads, _, _, head_dim = pool.shape
    (count,) = table.shape
    return b.reshape(read_blocks(b, pool, table), (kv_heads, count * BLOCK, head_dim), hint="span")


def block_of(b: Builder, slot: Value) -> tuple[Value, Value]:
    """(slot // BLOCK, slot % BLOCK) of an i32 slot."""
    size = b.constant(BLOCK, (), "i32", hint="block_size")
    return b.divide(slot, size, hint="block"), b.remainder(slot, size, hint="in_block")


def write_chunk(b: Builder, pool: Value, table: Value, start: Value, kv: Value) -> Value:
    """The pool with a chunk's K or V [kv_heads, S, head_dim] (S whole blocks) written at
    slots start..start+S-1 (`start` a multiple of BLOCK) through `table`: one update of a
    block at a time, each in place (a `stablehlo.scatter` of the blocks made IREE 3.13 copy
    the whole pool in every call)."""
    kv_heads, s, head_dim = kv.shape
    first, _ = block_of(b, start)
    blocks = table_entries(b, table, first, s // BLOCK, "chunk_blocks")
    zero = b.constant(0, (), "i32", hint="zero")
    for j in range(s // BLOCK):
        block = b.reshape(b.slice(blocks, (j,), (j + 1,), hint="block"), (), hint="block")
        piece = b.reshape(b.slice(kv, (0, j * BLOCK, 0), (kv_heads, (j + 1) * BLOCK, head_dim), hint="piece"),
                          (kv_heads, 1, BLOCK, head_dim), hint="piece")
        pool = b.dynamic_update_slice(pool, piece, [zero, block, zero, zero], hint="pages")
    return pool


def write_token(b: Builder, pool: Value, table: Value, slot: Value, kv: Value) -> Value:
    """The pool with one token's K or V [kv_heads, 1, head_dim] written at `slot` through `table`."""
    kv_heads, _, head_dim = kv.shape
    index, row = block_of(b, slot)
    block = b.reshape(b.dynamic_slice(table, [index], (1,), hint="token_block"), (), hint="token_block")
    zero = b.constant(0, (), "i32", hint="zero")
    update = b.reshape(kv, (kv_heads, 1, 1, head_dim), hint="token")
    return b.dynamic_update_slice(pool, update, [zero, block, row, zero], hint="pages")
