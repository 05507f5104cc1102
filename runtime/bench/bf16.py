"""How fast each precision runs a representative graph on a target: one vision block and
one text decode step (and a 512-token prefill) at Qwen3-VL-2B widths, compiled for the
target and run here.

`qwen3vl` builds bf16 in the target's fast form (`emitter.precision.Precision.for_target`):
bf16 operands where the bf16 dot product runs at twice the f32 rate, else bf16 weights widened to f32 inside
each matmul ("bf16-f32"). Without that, IREE 3.13 lowers a bf16 x bf16 matmul for an AVX2
CPU to one scalar loop (bf16 loads widened by bit masking, a scalar FMA each), about 50x
slower than f32. `time_forms` measures the forms side by side, alternating, in this process
(tests/test_bf16_forms.py; benchmarks/bench_bf16.py prints it for the host)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from emitter.config import PRESETS
from emitter.vision import graph_weights
from emitter.text import text_weights
from emitter.text_module import emit_text_module
from emitter.text_shape import MODULE_NAME as TEXT_MODULE, TextShape, decode_name, prefill_name
from emitter.text_config import TextConfig
from emitter.vision import emit_vision_module, input_specs

from runtime.artifact.archive import spec_bytes
from runtime.artifact.compiler import compile_mlir
from runtime.artifact.iree_module import LoadedModule, device_config, parameters_module

VISION_BUCKET = 256
TEXT_CONTEXT = 512
PREFILL = 512
# One decoder layer at Qwen3-VL-2B's widths; a small vocabulary keeps lm_head from dominating.
TEXT_2B_LAYER = TextConfig(vocab_size=8192, hidden_size=2048, intermediate_size=6144, num_hidden_layers=1,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=5e6,
                           mrope_section=(24, 20, 20))


def vision_2b_block():
    """The 2B tower cut to its first block (no DeepStack tap before it) and its merger."""
    return dataclasses.replace(PRESETS["qwen3-vl-2b"], depth=1, deepstack_visual_indexes=())


def _random(shape, dtype, rng, scale):
    import ml_dtypes
    x = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
    return x.astype(ml_dtypes.bfloat16) if dtype == "bf16" else x


def vision_call(precision: str, target: str, config, seed: int = 0):
    """A callable running the one-block tower (weights from parameters) on random inputs."""
    cfg, rng = vision_2b_block(), np.random.default_rng(seed)
    specs = graph_weights(cfg, precision)
    arrays = [(s.name, _random(s.shape, s.dtype, rng, 1 / np.sqrt(s.shape[-1]))) for s in specs]
    module = LoadedModule(compile_mlir(emit_vision_module(cfg, VISION_BUCKET, precision=precision,
                                                          weights="parameters"), target),
                          config=config, modules=[parameters_module(config, arrays)])
    n = VISION_BUCKET
    inputs = [module.upload(a) for a in (
        rng.standard_normal((n, cfg.patch_dim), dtype=np.float32),
        rng.integers(0, cfg.num_position_embeddings, (4, n), dtype=np.int32),
        np.full((4, n), 0.25, np.float32),
        rng.integers(0, 16, (2, n), dtype=np.int32),
        np.zeros((n,), np.int32))]
    assert [tuple(x.shape) for x in inputs] == [s[1] for s in input_specs(cfg, n)]
    call = lambda: module(*inputs)  # noqa: E731
    call.keep = arrays
    return call


def text_call(precision: str, target: str, config, seed: int = 0, prefill: bool = False):
    """A callable running one decode step (or a PREFILL-token prefill) of the one-layer
    2B-width language model."""
    cfg, rng = TEXT_2B_LAYER, np.random.default_rng(seed)
    arrays = [(s.name, _random(s.shape, s.dtype, rng, 1 / np.sqrt(s.shape[-1]))) for s in text_weights(cfg, precision)]
    shape = TextShape((PREFILL,), TEXT_CONTEXT)
    text = emit_text_module(cfg, shape, 0, precision, functions="prefill" if prefill else "decode")
    table = np.arange(1, shape.max_blocks + 1, dtype=np.int32)  # the whole 512-slot context
    module = LoadedModule(compile_mlir(text, target), config=config, module_name=TEXT_MODULE,
                          function=prefill_name(PREFILL) if prefill else decode_name(1),
                          modules=[parameters_module(config, arrays)])
    if prefill:
        s = PREFILL
        host = [rng.integers(0, cfg.vocab_size, (s,), dtype=np.int32), np.zeros((s,), np.int32),
                np.zeros((s, cfg.hidden_size), np.float32), np.tile(np.arange(s, dtype=np.int32), (3, 1)),
                np.array(s - 1, np.int32), np.array(0, np.int32), table]
    else:
        host = [np.array([7], np.int32), np.full((3, 1), 40, np.int32), np.array([40], np.int32), table[None]]
    inputs = [module.upload(a) for a in host]
    call = lambda: module(*inputs)  # noqa: E731
    call.keep = arrays
    return call


def decode_call(precision: str, target: str, config, seed: int = 0):
    return text_call(precision, target, config, seed)


def prefill_call(precision: str, target: str, config, seed: int = 0):
    return text_call(precision, target, config, seed, prefill=True)


def time_forms(calls: dict, rounds: int = 5) -> dict[str, float]:
    """The fastest of `rounds` calls of each, alternating (one warm-up call each first)."""
    for call in calls.values():
        call()
    best = {name: float("inf") for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def measure(target: str, precisions, rounds: int = 5, graphs=("vision", "decode")) -> dict[str, dict[str, float]]:
    """{graph: {precision: best seconds}} for each graph in `graphs` and each precision."""
    config = device_config(target)
    makers = {"vision": vision_call, "decode": decode_call, "prefill": prefill_call}
    return {graph: time_forms({p: makers[graph](p, target, config) for p in precisions}, rounds) for graph in graphs}


def weight_bytes(graph: str, precision: str) -> int:
    """Bytes of the graph's weights under `precision` (what a decode step reads)."""
    specs = graph_weights(vision_2b_block(), precision) if graph == "vision" else \
        text_weights(TEXT_2B_LAYER, precision)
    return sum(map(spec_bytes, specs))
