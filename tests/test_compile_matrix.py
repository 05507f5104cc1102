"""Every valid config compiles in every variant.

Randomly drawn (seeded, so every run draws the same) valid vision configs, plus the one
that once failed, each compiled the way the runtime compiles it: `runtime.artifact.build`'s
artifact module for the bucket ladder, one entry per bucket, plain (`encode_<B>`, what
`qwen3vl run` builds) or diagnostics (`encode_<B>_diagnostics`, what `qwen3vl oracle`
builds), weights as parameters, the llvm-cpu target's real flags, the real iree-compile;
in f32 and in bf16. The regression config runs in both precisions (f32 in the quick suite);
to keep CI's time, each drawn config runs in one precision (they alternate). All but the
regression in f32 are marked slow (CI runs them too).

Why the diagnostics entries once failed: a returned stage computed in a matmul's
epilogue (a merger's fc1, a block's attention projection) was fused into one dispatch
with the value computed from it (GELU(fc1), the residual sum), so the dispatch wrote two
results out of the data-tiled layout, and at some shapes IREE 3.13 vectorized the second
unpack whole: "large vector sizes (32768 bytes)". The emitter now writes each returned
stage out behind an optimization_barrier (`emitter.layers.Stages`)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import iree.runtime as rt

from conftest import graph_weights
from emitter.builder import Builder
from emitter.config import PRESETS, VisionConfig
from emitter.vision import graph_weights as weight_specs
from emitter.identity import DEFAULT_LADDER
from emitter.policy import DEFAULT_POLICY
from emitter.targets import DEFAULT_TARGET
from emitter.vision import emit_vision_module, entry_name, render_module
from runtime.artifact.build import DEFAULT_BINDING, BuildPlan, emit_graph
from runtime.artifact.compiler import compile_mlir
from runtime.artifact.iree_module import LoadedModule
from runtime.inputs.packing import host_inputs

SEED = 2026
DRAWN = 5
PRECISIONS = ("f32", "bf16")
VARIANTS = ("plain", "diagnostics")

# Found by trying an unseen checkpoint: its diagnostics entry at bucket 512 did not compile.
UNSEEN = VisionConfig(depth=4, hidden_size=96, intermediate_size=200, out_hidden_size=80, num_heads=6,
                      deepstack_visual_indexes=(0, 2), num_position_embeddings=144)


def draw_config(rng: np.random.Generator, head_dim: int, large_table: bool) -> VisionConfig:
    """A valid config of unusual sizes: `head_dim` (a multiple of 4), 1-8 heads, an odd MLP
    width and output width, 2-4 blocks with DeepStack taps at the first and the last block
    (and maybe one between), a square position table of side 3-12 or 32-64."""
    heads = int(rng.integers(1, 9))
    depth = int(rng.integers(2, 5))
    hidden = heads * head_dim
    middle = {int(rng.integers(1, depth - 1))} if depth > 2 and rng.random() < 0.5 else set()
    side = int(rng.integers(32, 65) if large_table else rng.integers(3, 13))
    return VisionConfig(depth=depth, hidden_size=hidden, num_heads=heads,
                        intermediate_size=int(rng.integers(hidden // 2, 4 * hidden)) | 1,
                        out_hidden_size=int(rng.integers(8, 2 * hidden)) | 1,
                        deepstack_visual_indexes=tuple(sorted({0, depth - 1} | middle)),
                        num_position_embeddings=side * side)


def draw_configs(seed: int = SEED, count: int = DRAWN) -> list[VisionConfig]:
    """`count` configs; head_dim runs 16 and 128 first, then any multiple of 4 between;
    position tables alternate small and large."""
    rng = np.random.default_rng(seed)
    head_dims = [16, 128] + [4 * int(rng.integers(4, 33)) for _ in range(count - 2)]
    return [draw_config(rng, d, large_table=i % 2 == 1) for i, d in enumerate(head_dims)]


CONFIGS = {"unseen": UNSEEN, **{f"drawn{i}": cfg for i, cfg in enumerate(draw_configs())}}
# name -> the precisions it compiles in: all for the regression config, alternating for the drawn ones.
SAMPLED = {"unseen": PRECISIONS, **{f"drawn{i}": (PRECISIONS[i % 2],) for i in range(DRAWN)}}
QUICK = {("unseen", "f32")}  # the regression itself; the rest of the matrix is marked slow
CASES = [pytest.param(name, precision, variant, id=f"{name}-{precision}-{variant}",
                      marks=[] if (name, precision) in QUICK else [pytest.mark.slow])
         for name, precisions in SAMPLED.items() for precision in precisions for variant in VARIANTS]


def artifact_plan(cfg: VisionConfig, precision: str, variant: str) -> BuildPlan:
    """What the runtime builds: the ladder, as `qwen3vl run` (plain) or `qwen3vl oracle` does."""
    return BuildPlan(cfg, "compile matrix", DEFAULT_POLICY, DEFAULT_LADDER, DEFAULT_TARGET,
                     diagnostics=variant == "diagnostics", precision=precision, weights=DEFAULT_BINDING)


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def compile_plan(plan: BuildPlan) -> bytes:
    return compile_mlir(emit_graph(plan), plan.target)


@pytest.fixture(scope="module")
def artifacts(request):
    """(name, precision, variant) -> the future of its compiled artifact. Every selected case is
    started at once, as many at a time as there are cores: one iree-compile keeps about
    one core busy, and this matrix is most of the suite's compile time."""
    selected = [tuple(item.callspec.params[k] for k in ("name", "precision", "variant"))
                for item in request.session.items if item.originalname == "test_config_compiles_in_every_variant"]
    with ThreadPoolExecutor(max_workers=cores()) as pool:
        yield {case: pool.submit(compile_plan, artifact_plan(CONFIGS[case[0]], *case[1:])) for case in selected}
        pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("name, precision, variant", CASES)
def test_config_compiles_in_every_variant(artifacts, name, precision, variant):
    vmfb = artifacts[name, precision, variant].result()
    module = rt.VmModule.copy_buffer(rt.VmInstance(), vmfb)
    expected = {entry_name(b, variant == "diagnostics") for b in DEFAULT_LADDER}
    assert expected <= set(module.function_names), f"{name} {precision} {variant}: entries missing from the vmfb"


def test_drawn_configs_cover_the_matrix():
    """The draw holds what the matrix promises (so a new seed cannot quietly shrink it)."""
    drawn = draw_configs()
    assert draw_configs() == drawn, "the draw is deterministic"
    assert {16, 128} <= {c.head_dim for c in drawn}
    assert all(c.deepstack_visual_indexes[0] == 0 and c.deepstack_visual_indexes[-1] == c.depth - 1 for c in drawn)
    assert min(c.grid_side for c in drawn) <= 12 and max(c.grid_side for c in drawn) >= 32
    assert all(c.intermediate_size % 2 and c.out_hidden_size % 2 for c in drawn)
    assert any(c.hidden_size & (c.hidden_size - 1) for c in drawn), "a hidden size that is not a power of two"
    assert {p for name, ps in SAMPLED.items() if name != "unseen" for p in ps} == set(PRECISIONS)


def test_optimization_barrier_passes_values_through():
    x = np.random.default_rng(SEED).standard_normal((5, 7)).astype(np.float32)
    x[0, :3] = [-0.0, np.inf, np.nan]
    b = Builder()
    xa = b.argument("x", x.shape)
    module = LoadedModule(compile_mlir(render_module(b, [("y", b.optimization_barrier(xa))])))
    np.testing.assert_array_equal(module(x)[0].view(np.uint32), x.view(np.uint32))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_diagnostics_outputs_equal_plain_outputs_bit_for_bit(precision):
    """The barriers change where dispatches split, not what they compute."""
    cfg, bucket, grids = PRESETS["tiny"], 64, [(1, 4, 6), (1, 6, 4)]
    rng = np.random.default_rng(SEED)
    pixels = rng.uniform(-1, 1, (sum(t * h * w for t, h, w in grids), cfg.patch_dim)).astype(np.float32)
    state = {name: rng.standard_normal(shape).astype(np.float32) * 0.1
             for name, shape in ((s.name, s.shape) for s in weight_specs(cfg))}
    weights = graph_weights(cfg, state)
    if precision == "bf16":
        import ml_dtypes
        weights = [w.astype(ml_dtypes.bfloat16) if s.dtype == "bf16" else w
                   for w, s in zip(weights, weight_specs(cfg, precision))]
    args = [*host_inputs(pixels, grids, cfg, bucket), *weights]
    outputs = 1 + len(cfg.deepstack_visual_indexes)
    plain, diagnostics = (LoadedModule(compile_mlir(emit_vision_module(cfg, bucket, diag, precision=precision)))(*args)
                          for diag in (False, True))
    for k in range(outputs):
        np.testing.assert_array_equal(diagnostics[k].view(np.uint32), plain[k].view(np.uint32))
