"""Decode updates the KV cache in place: no step copies a whole cache (IREE did, two per
layer, while the loaded cache was still to be read by the attention: docs/text.md), in the
graph's attention (f32) and through the decode-attention kernel (q8_0's graph), whose
dispatch takes the pools as operands. And a step is one queue submission of every layer's
dispatches (beside one-dispatch readbacks of the slot's block): a barrier a layer made it
one submission a layer, the host waiting on each."""

from __future__ import annotations

from dataclasses import replace

import pytest

from emitter.precision import precision as precision_of
from emitter.text_config import TEXT_PRESETS
from runtime.bench import decode_profile as bench
from runtime.artifact.compiler import compile_mlir


@pytest.mark.parametrize("precision", ["f32", "q8_0"])
def test_decode_step_copies_no_whole_cache(tmp_path, precision):
    context = 512
    # widths the Q8_0 kernel's tiles divide
    cfg = replace(TEXT_PRESETS["tiny"], num_hidden_layers=2, hidden_size=64, intermediate_size=128)
    vmfb, archive, profile = tmp_path / "decode.vmfb", tmp_path / "w.irpa", tmp_path / "decode.ireeprof"
    module = bench.decode_module(cfg, context, precision)
    assert ("decode_attention" in module) == (precision == "q8_0")
    vmfb.write_bytes(compile_mlir(module, extra_flags=precision_of(precision).compile_flags()))
    bench.write_archive(cfg, precision, archive)
    steps = 2
    bench.step_ms(vmfb, archive, context - 1, steps, 1, profile=profile)
    cache_bytes = cfg.num_key_value_heads * context * cfg.head_dim * 4
    copies = bench.copy_lengths(profile)
    assert copies, "the profile recorded no command-buffer copies at all (the check would see nothing)"
    assert max(copies) < cache_bytes, copies
    multi = [n for n in bench.submission_sizes(profile) if n > 1]
    assert len(multi) == steps, f"submissions of several dispatches in {steps} steps: {multi}"
