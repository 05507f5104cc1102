"""Mutation tests: deliberately wrong graphs, emitted, compiled and run for real, must fail
the oracle under its DEFAULT tolerances.

Each mutation swaps one of the emitter's layer functions in-process (the session emits,
compiles and caches the wrong graph; the artifact identity hashes the graph text, so
the wrong artifact never stands in for the right one, nor the other way round). The
errors they make are small on purpose: LayerNorm eps 1e-5 instead of 1e-6 and an
attention scale off by 1e-4 move the worst stage by rel L2 2.3e-5 and 6.7e-5 on this
tiny checkpoint, against 7.9e-7 for the real graph.
"""

from __future__ import annotations

import functools

import pytest

import emitter.attention as attention
import emitter.layers as layers
import emitter.vision as vision
from emitter.config import PRESETS
from helpers import write_images
from emitter.identity import artifact_identity
from runtime.artifact.build import make_plan
from runtime.oracle.run import DEFAULT_TOLERANCES, check_report, format_table, run_oracle
from runtime.checkpoints.synthetic import DEFAULT_PROCESSOR, write_checkpoint

TINY = PRESETS["tiny"]
BUCKET = 64
ORIGINAL = {"layer_norm": layers.layer_norm, "softmax": layers.softmax, "rotary_tables": layers.rotary_tables}


def eps_1e5():
    wrong = functools.partial(ORIGINAL["layer_norm"], eps=1e-5)
    return [(vision, "layer_norm", wrong), (layers, "layer_norm", wrong)]  # blocks, mergers


def tanh_gelu_in_mergers():
    return [(layers, "gelu_erf", layers.gelu_tanh)]  # only the mergers use erf


def attention_scale_x1_0001():
    def softmax(b, scores):  # softmax(1.0001 * (s*q.k + mask)) == softmax(1.0001*s*q.k + mask)
        return ORIGINAL["softmax"](b, b.multiply(scores, b.scalar(1.0001, scores)))
    return [(attention, "softmax", softmax)]


def rotate_half_swapped():
    def apply_rotary(b, x, cos, sin):  # cat(x2, -x1) where rotate_half is cat(-x2, x1)
        n, heads, d = x.shape
        first = b.slice(x, (0, 0, 0), (n, heads, d // 2))
        second = b.slice(x, (0, 0, d // 2), (n, heads, d))
        rotated = b.concatenate([second, b.negate(first)], 2)
        cos = b.broadcast_in_dim(cos, x.shape, [0, 2])
        sin = b.broadcast_in_dim(sin, x.shape, [0, 2])
        return b.add(b.multiply(x, cos), b.multiply(rotated, sin))
    return [(attention, "apply_rotary", apply_rotary)]


def rotary_row_col_swapped():
    def rotary_tables(b, rope_pos, inv_freq, head_dim):  # the (row, col) halves of the angles swapped
        _, n = rope_pos.shape
        swapped = b.concatenate([b.slice(rope_pos, (1, 0), (2, n)), b.slice(rope_pos, (0, 0), (1, n))], 0)
        return ORIGINAL["rotary_tables"](b, swapped, inv_freq, head_dim)
    return [(vision, "rotary_tables", rotary_tables)]


# mutation -> the stage the oracle must name first
MUTATIONS = {
    "layer_norm_eps_1e-5": (eps_1e5, "blocks.0.norm1"),
    "tanh_gelu_in_mergers": (tanh_gelu_in_mergers, "deepstack_merger_list.0.act"),
    "attention_scale_x1.0001": (attention_scale_x1_0001, "blocks.0.attn"),
    "rotate_half_swapped": (rotate_half_swapped, "blocks.0.attn"),
    "rotary_row_col_swapped": (rotary_row_col_swapped, "blocks.0.attn"),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny checkpoint, two non-square images (4x6 and 6x4 patches) and one shared cache."""
    root = tmp_path_factory.mktemp("mutations")
    model = root / "model"
    write_checkpoint(model, TINY, seed=2,
                     processor_policy_dict=dict(DEFAULT_PROCESSOR, size={"shortest_edge": 4096,
                                                                         "longest_edge": 32768}))
    images = write_images(root, [(96, 64), (60, 100)], stem="image")
    real = make_plan(str(model), None, (BUCKET,), None, True, None)
    return {"model": str(model), "images": images, "cache": str(root / "cache"),
            "identity": artifact_identity(real.fields())}


def oracle(setup):
    return run_oracle(setup["model"], setup["images"], cache_dir=setup["cache"], buckets=(BUCKET,))


def apply(monkeypatch, mutation):
    for module, name, function in mutation():
        monkeypatch.setattr(module, name, function)


def block_2_input_off():
    original = vision.block

    def block(b, x, w, *rest):  # rest ends with the block's name
        if rest[-1] == "blocks.2":
            x = b.add(x, b.scalar(1e-2, x))
        return original(b, x, w, *rest)
    return [(vision, "block", block)]


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_default_tolerances_flag_a_wrong_graph(setup, monkeypatch, name):
    mutation, first_stage = MUTATIONS[name]
    apply(monkeypatch, mutation)
    plan = make_plan(setup["model"], None, (BUCKET,), None, True, None)
    assert artifact_identity(plan.fields()) != setup["identity"], "the wrong graph has its own artifact"
    report = oracle(setup)
    check_report(report)
    assert report["tolerances"]["max_rel_l2"] == DEFAULT_TOLERANCES["f32"]["max_rel_l2"]
    first = report["first_failure"]
    assert not report["pass"] and first is not None, format_table(report)
    assert first["stage"] == first_stage and first["verdict"] == "local", format_table(report)


def test_a_wrong_block_is_local_and_what_follows_it_inherited(setup, monkeypatch):
    """Block 2 adds 1e-2 to its input: wrong on the graph's own input (local); every stage
    after it that fails is right on its own input (inherited)."""
    apply(monkeypatch, block_2_input_off)
    report = oracle(setup)
    by_stage = {c["stage"]: c for c in report["comparisons"]}
    assert report["first_failure"]["stage"] == "blocks.2" and report["first_failure"]["verdict"] == "local"
    assert by_stage["blocks.1"]["pass"] and by_stage["deepstack_merger_list.0"]["pass"]
    assert by_stage["blocks.3.input"]["alias_of"] == "blocks.2" and not by_stage["blocks.3.input"]["pass"]
    assert by_stage["blocks.3"]["verdict"] == "inherited", format_table(report)
    later = [c for c in report["comparisons"][report["comparisons"].index(by_stage["blocks.2"]) + 1:]
             if not c["pass"] and "alias_of" not in c]
    assert later and all(c["verdict"] == "inherited" for c in later), format_table(report)


def test_the_real_graph_passes_from_the_same_cache(setup):
    """After the wrong graphs were compiled into the same cache, the right one still comes
    out of it and passes, with room to spare under the defaults."""
    report = oracle(setup)
    assert report["pass"], format_table(report)
    worst = max(c["rel_l2"] for c in report["comparisons"])
    assert worst < DEFAULT_TOLERANCES["f32"]["max_rel_l2"] / 3, worst
