"""The KV cache's blocks on the host side: who holds which block of the device's pools
(emitter/kv_pages.py), and the prefix cache. One place owns the blocks; the session and
the server's scheduler ask it.

- `BlockPool`: blocks 1..n-1 (block 0 is the module's spare: unused table entries name
  it), each with a reference count. A free block is taken from the front of the free list
  (least recently freed first).
- Prefix caching: a full block of a prompt, once prefilled, is keyed by its content (the
  key of the block before it, its token ids, M-RoPE positions, and the embeddings and
  DeepStack features of its image rows: `block_keys`) and stays findable while it is
  held, and after, while free, until it is taken for something else (LRU). A later
  prompt with the same first blocks shares them, counted, without copying, and prefills
  only the rest. Only blocks a prefill wrote are keyed: a decode step rounds its token's
  K/V otherwise than a prefill would, and a hit must give what a miss gives, bit for bit.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from emitter.kv_pages import BLOCK


def block_keys(prompt, count: int) -> list[bytes]:
    """The keys of the prompt's first `count` full blocks (a `chat.Prompt`): each a digest of
    the key before it and everything a prefill of the block reads."""
    rows = {} if prompt.visual is None else {int(r): i for i, r in enumerate(prompt.visual)}
    keys, previous = [], b""
    for n in range(count):
        digest = hashlib.blake2b(previous, digest_size=16)
        lo, hi = n * BLOCK, (n + 1) * BLOCK
        digest.update(np.ascontiguousarray(prompt.ids[lo:hi], np.int64).tobytes())
        digest.update(np.ascontiguousarray(prompt.positions[:, lo:hi], np.int64).tobytes())
        visual = [rows[r] for r in range(lo, hi) if r in rows]
        if visual:
            digest.update(np.asarray(visual, np.int64).tobytes())
            digest.update(np.ascontiguousarray(prompt.embeds[visual]).tobytes())
            if prompt.deepstack is not None:
                digest.update(np.ascontiguousarray(prompt.deepstack[:, visual]).tobytes())
        previous = digest.digest()
        keys.append(previous)
    return keys


@dataclass
class Blocks:
    """A sequence's blocks, in slot order: blocks[i] holds slots i*BLOCK..(i+1)*BLOCK-1."""
    ids: list[int] = field(default_factory=list)
    keyed: int = 0  # how many leading blocks were found in the prefix cache
    keys: list[bytes] = field(default_factory=list)  # `block_keys` of its prompt's full blocks

    @property
    def slots(self) -> int:
        return len(self.ids) * BLOCK


class BlockPool:
    def __init__(self, blocks: int, prefix_cache: bool = True):
        self.blocks = blocks
        self.prefix_cache = prefix_cache
        self.refs = [0] * blocks
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, blocks))
        self.key_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}
        self.hit_tokens = 0  # prompt tokens found in the prefix cache, all told

    @property
    def usable(self) -> int:
        return self.blocks - 1

    @property
    def used(self) -> int:
        """Blocks held by some sequence."""
        return self.usable - len(self.free)

    def can_take(self, count: int) -> bool:
        return count <= len(self.free)

    def take(self, count: int) -> list[int]:
        """`count` free blocks (least recently freed first); their old keys forgotten."""
        if count > len(self.free):
            raise MemoryError(f"KV cache: {count} blocks wanted, {len(self.free)} free")
        out = []
        for _ in range(count):
            block, _ = self.free.popitem(last=False)
            key = self.key_of.pop(block, None)
            if key is not None:
                del self.block_of[key]
            self.refs[block] = 1
            out.append(block)
        return out

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each; a block no one holds is free (and, keyed, still findable)."""
        for block in reversed(blocks):  # a sequence's last blocks are the first to be taken again
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None

    def share(self, keys: list[bytes]) -> list[int]:
        """The longest run of cached blocks with these leading keys, one more reference each."""
        out = []
        if not self.prefix_cache:
            return out
        for key in keys:
            block = self.block_of.get(key)
            if block is None:
                break
            if self.refs[block] == 0:
                del self.free[block]
            self.refs[block] += 1
            out.append(block)
        return out

    def remember(self, blocks: list[int], keys: list[bytes]) -> None:
        """Key these freshly prefilled full blocks (a key already held by another block is left there)."""
        if not self.prefix_cache:
            return
        for block, key in zip(blocks, keys):
            if key not in self.block_of and block not in self.key_of:
                self.block_of[key] = block
                self.key_of[block] = key

    def table(self, seq: Blocks, length: int) -> np.ndarray:
        """The first `length` entries of `seq`'s block table, [length] i32 (entries past its
        blocks name block 0)."""
        out = np.zeros(length, np.int32)
        ids = seq.ids[:length]
        out[:len(ids)] = ids
        return out
