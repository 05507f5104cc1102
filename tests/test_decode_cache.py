"""Decode updates the KV cache in place: no step copies a whole cache (IREE did, two per
layer, while the loaded cache was still to be read by the attention: docs/text.md)."""

from __future__ import annotations

from dataclasses import replace

from emitter.text_config import TEXT_PRESETS
from runtime.bench import decode_profile as bench
from runtime.artifact.compiler import compile_mlir


def test_decode_step_copies_no_whole_cache(tmp_path):
    context = 512
    cfg = replace(TEXT_PRESETS["tiny"], num_hidden_layers=2)
    vmfb, archive, profile = tmp_path / "decode.vmfb", tmp_path / "w.irpa", tmp_path / "decode.ireeprof"
    vmfb.write_bytes(compile_mlir(bench.decode_module(cfg, context, "f32")))
    bench.write_archive(cfg, "f32", archive)
    bench.step_ms(vmfb, archive, context - 1, 2, 1, profile=profile)
    cache_bytes = cfg.num_key_value_heads * context * cfg.head_dim * 4
    copies = bench.copy_lengths(profile)
    assert copies, "the profile recorded no command-buffer copies at all (the check would see nothing)"
    assert max(copies) < cache_bytes, copies
