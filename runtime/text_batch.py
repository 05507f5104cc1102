"""The language model with a KV cache of `rows` rows (emitter/text_batch.py): a prompt is
prefilled into a row, then `decode_batch` gives every row one new token in one call (the
weights read once a step for all of them). The server's continuous batching runs on it."""

from __future__ import annotations

import numpy as np

from emitter.text import span_for
from emitter.text_batch import RESET, check_rows, copy_name, decode_name, emit_batch_module, lane_counts

from runtime.text import GenerateError, TextSession
from runtime.artifact.iree_module import invoke


class BatchTextSession(TextSession):
    """`TextSession`'s module and weights, batched: rows 0..rows-1, one sequence each."""

    def __init__(self, model_dir, rows: int, **options):
        self.rows = check_rows(rows)
        super().__init__(model_dir, **options)

    def _graph(self) -> str:
        return emit_batch_module(self.cfg, self.buckets, self.context, self.rows, self.deepstack_layers,
                                 self.precision, self.kv_cache_dtype)

    def _load(self):
        """The module loaded, and its KV cache stored whole once (`reset`, emitter/text_batch.py)."""
        module = super()._load()
        invoke(module[RESET], np.zeros(2 * self.cfg.num_hidden_layers, np.float32))
        return module

    def prefill_row(self, row: int, prompt) -> np.ndarray:
        """Prefill `prompt` (a `chat.Prompt`) into cache row `row`, chunk by chunk: the
        logits [vocab] of its last token."""
        return self.prefill(prompt.ids, prompt.positions, prompt.visual, prompt.embeds, prompt.deepstack, row=row)

    def copy_prompt(self, source: int, target: int, length: int) -> None:
        """Cache row `source`'s first `length` slots (a prompt prefilled there) into row
        `target`: what prefilling the same prompt into `target` would have written."""
        invoke(self.module[copy_name(span_for(length, self.slots))], np.array(source, np.int32),
               np.array(target, np.int32))

    def decode_batch(self, rows, tokens, rope_positions, slots) -> np.ndarray:
        """One step for the sequences in cache rows `rows` (distinct): row rows[i] is fed
        `tokens[i]` at text position (cache slot) `slots[i]` and M-RoPE position
        `rope_positions[i]`; their logits [len(rows), vocab]. Runs the smallest
        `decode_batch_<B>` that holds them, over the shortest span that holds the longest
        (bit for bit what the one-sequence module gives each, tested); spare lanes repeat lane 0 (its write, twice), so
        rows not in `rows` keep what they hold."""
        n = len(rows)
        lanes = next(b for b in lane_counts(self.rows) if b >= n)
        pad = lambda values: np.concatenate([np.asarray(values, np.int32).reshape(n),  # noqa: E731
                                             np.repeat(np.asarray(values, np.int32).reshape(n)[:1], lanes - n)])
        tokens, slots, rope, rows = pad(tokens), pad(slots), pad(rope_positions), pad(rows)
        if slots.max() >= self.context:
            raise GenerateError(f"context of {self.context} tokens is full; give a larger --context")
        self._check_ids(tokens)
        positions = np.repeat(rope.reshape(1, lanes), 3, axis=0)
        span = span_for(int(slots.max()), self.slots)  # the filled span of the longest
        result = invoke(self.module[decode_name(lanes, span, self.slots)], tokens, positions, slots, rows)
        return np.array(result.to_host(), dtype=np.float32, copy=True).reshape(lanes, -1)[:n]
