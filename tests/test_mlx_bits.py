"""`--precision mlx`: an MLX-quantized checkpoint's language model run in its bits
(emitter/quant.py's affine layout). Checkpoints quantized by the real `mx.quantize` in
mlx-vlm's layout, 4 and 8 bits, groups of 32, 64 and 128, per-module settings and a module
left unquantized. The session in its bits against the f32 session over the same folder
(its weights dequantized at load, bit for bit `mx.dequantize`'s): relL2 <= 1e-5; the
archive holds the quantized weights in i8 / i4; bad settings are one line."""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import numpy as np
import pytest

from conftest import rel_l2
from emitter import quant
from emitter.config import ConfigError
from emitter.precision import precision as precision_of
from emitter.text import text_weights
from emitter.text_config import LM_HEAD, TEXT_PREFIX, TEXT_PRESETS
from runtime.bench.mlx_memory import measure, write_mlx_text
from runtime.checkpoints.synthetic_mlx import STORED_HEAD, STORED_PREFIX, stored_name
from runtime.checkpoints.text import native_weights, load_text_weights
from runtime.checkpoints.tensor_files import CheckpointError
from runtime.text import TextSession

mx = pytest.importorskip("mlx.core")
pytestmark = pytest.mark.parity  # the checkpoints are quantized by mlx itself, the reference

# Widths that groups of 32, 64 and 128 all divide.
CFG = dataclasses.replace(TEXT_PRESETS["tiny"], hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, mrope_section=(6, 5, 5))
TOL = 1e-5
# (bits, group, per-module settings keyed by module path as mlx-vlm writes them, tied embeddings)
CASES = {
    "4bit-g32": (4, 32, {STORED_PREFIX + "layers.0.mlp.down_proj": {"bits": 8, "group_size": 64},
                         STORED_PREFIX + "layers.1.self_attn.o_proj": False,
                         STORED_HEAD: {"bits": 8, "group_size": 128}}, False),
    "8bit-g128": (8, 128, {STORED_PREFIX + "layers.1.mlp.gate_proj": {"bits": 4, "group_size": 64}}, True),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    bits, group, modules, tied = CASES[request.param]
    cfg = dataclasses.replace(CFG, tie_word_embeddings=tied)
    folder = tmp_path_factory.mktemp(request.param) / "m"
    expected = write_mlx_text(folder, cfg, bits, group, modules)
    return folder, cfg, expected


def answer(model_dir, cache, precision: str, steps: int = 3) -> np.ndarray:
    """Logits of a 37-token prompt (a 32-row chunk dequantizes, the last row and the decode
    steps run split-K) and of `steps` greedy decode steps, [1 + steps, vocab]."""
    session = TextSession(model_dir, buckets=(32,), context=64, cache_dir=cache, precision=precision)
    n = 37
    rows = [session.prefill(np.arange(n) * 7 % CFG.vocab_size, np.broadcast_to(np.arange(n), (3, n)))]
    for step in range(steps):
        rows.append(session.decode(int(np.argmax(rows[-1])), n + step))
    return np.stack(rows), session


def test_layouts_follow_the_checkpoint(checkpoint):
    """Each quantized weight's bits and group as stored (per-module settings first); a
    module kept float is not among them; the f32 reader is mx.dequantize bit for bit."""
    folder, cfg, expected = checkpoint
    layouts = {name: (bits, group) for name, bits, group in native_weights(folder, cfg)}
    assert set(layouts) == set(expected)
    weights = load_text_weights(folder, cfg)
    for name, theirs in expected.items():
        np.testing.assert_array_equal(weights[name].view(np.uint32), theirs.view(np.uint32), err_msg=name)
    if not cfg.tie_word_embeddings:
        assert layouts[TEXT_PREFIX + "layers.0.mlp.down_proj.weight"] == (8, 64)
        assert layouts[LM_HEAD] == (8, 128)
        assert TEXT_PREFIX + "layers.1.self_attn.o_proj.weight" not in layouts


def test_in_its_bits_equals_f32_over_mx_dequantize(checkpoint):
    """The session in its bits against the f32 session over the same checkpoint, whose
    weights are mx.dequantize's: the same numbers, so relL2 <= 1e-5 (prefill and decode)."""
    folder, cfg, _ = checkpoint
    ours, session = answer(folder, folder.parent / "cache", "mlx")
    reference, _ = answer(folder, folder.parent / "cache", "f32")
    errors = [rel_l2(a, b) for a, b in zip(ours, reference)]
    print(f"{folder.parent.name}: relL2 against f32 over mx.dequantize {max(errors):.1e}")
    assert max(errors) <= TOL, errors
    dtypes = {s.name: s.dtype for s in text_weights(session.cfg, session.precision)}
    for name, bits, _ in session.cfg.native_weights:  # the archive's entries in their bits
        assert dtypes[name] == quant.STORAGE_DTYPE[bits] and dtypes[quant.biases_name(name)] == "f32"


def test_the_archive_is_in_its_bits(checkpoint):
    """The mlx archive beside the f32 one: each quantized weight q plus scales and biases
    (about 1/8 or 1/4 of its f32 bytes, plus 2 x 4 bytes per group); no f32 copy of one."""
    folder, cfg, expected = checkpoint
    cache = folder.parent / "cache"
    sizes = {}
    for precision in ("mlx", "f32"):
        session = TextSession(folder, buckets=(32,), context=64, cache_dir=cache, precision=precision)
        session._open_weights()
        sizes[precision] = session.archive_path.stat().st_size
    specs = text_weights(dataclasses.replace(cfg, native_weights=native_weights(folder, cfg)))
    stored = sum(int(np.prod(s.shape)) * {"i8": 1, "i4": 0.5, "f32": 4}[s.dtype] for s in specs)
    print(f"archive: {sizes['mlx'] / 1e6:.2f} MB in its bits, {sizes['f32'] / 1e6:.2f} MB in f32")
    assert sizes["mlx"] < 1.05 * stored + 65536 and sizes["mlx"] < 0.45 * sizes["f32"]


def test_mlx_precision_is_part_of_the_identity(checkpoint):
    from emitter.identity import text_artifact_fields
    from emitter.text_shape import TextShape
    folder, cfg, _ = checkpoint
    shape = TextShape((32,), 64)
    stored = dataclasses.replace(cfg, native_weights=native_weights(folder, cfg))
    other = dataclasses.replace(cfg, native_weights=tuple((n, b, 32 if g != 32 else 64) for n, b, g in
                                                          stored.native_weights))
    fields = [text_artifact_fields(c, shape, 0, "f32") for c in (cfg, stored, other)]
    assert len({f["graph_sha256"] for f in fields}) == 3
    assert len({json.dumps(f["weight_schema"]) for f in fields}) == 3
    # in its bits the module is compiled with the weight-only flags (one copy of the weights), recorded
    flags = [f["target"]["flags"] for f in fields]
    assert flags[1] == flags[2] == flags[0] + list(quant.WEIGHT_ONLY_FLAGS), flags


def test_mlx_precision_needs_a_quantized_checkpoint(tmp_path):
    folder = tmp_path / "m"
    write_mlx_text(folder, CFG, 4, 32, {f"{STORED_PREFIX}layers.{n}.{m}": False for n in range(2) for m in
                                       ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                        "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
                   | {STORED_PREFIX + "embed_tokens": False, STORED_HEAD: False})
    with pytest.raises(CheckpointError,
                       match=r"--precision native: no language-model weight is MLX-quantized in 8 or 4"):
        TextSession(folder, buckets=(32,), context=64, cache_dir=tmp_path / "cache", precision="mlx")


def test_int8_over_an_affine_checkpoint_is_one_line(checkpoint):
    folder, cfg, _ = checkpoint
    stored = dataclasses.replace(cfg, native_weights=native_weights(folder, cfg))
    with pytest.raises(ConfigError, match=re.escape("--precision int8: the checkpoint's weights are quantized and run "
                                                    "in their own bits")):
        text_weights(stored, "int8")


@pytest.mark.parametrize("form", ["mlx4", "mlx8"])
def test_decode_dispatches_read_the_bits(tmp_path, form):
    """With biases too, the decode dispatches contract the weights in their bits (f32 x i4
    or i8 -> f32), and none widens one to an f32 copy (as tests/test_quant.py checks int8/int4);
    built with the flags the session adds (`Precision.compile_flags`), nothing re-encodes them at load."""
    from runtime.artifact.compiler import compile_mlir
    from runtime.bench.decode_profile import NATIVE_FORMS, decode_module, graph_form

    bits = NATIVE_FORMS[form].dtype
    cfg = dataclasses.replace(CFG, tie_word_embeddings=False)
    stored, precision = graph_form(cfg, form)
    flags = precision_of(precision).compile_flags(stored.native_weights)
    compile_mlir(decode_module(cfg, 64, form), extra_flags=[*flags, f"--iree-hal-dump-executable-sources-to={tmp_path}"])
    names = [m for f in tmp_path.glob("*.mlir") for m in re.findall(r"export public @(\w+)", f.read_text())]
    contractions = [n for n in names if re.search(rf"_(matmul|vecmat|matvec)\w*_f32x{bits}xf32$", n)]
    widening = [n for n in names if "decode" in n and n.endswith(f"{bits}xf32") and n not in contractions]
    encoded = [n for n in names if re.search(rf"_encode_\w*x{bits}_to_", n)]
    assert flags and contractions and not widening and not encoded, names


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_nothing_is_expanded_to_f32(tmp_path):
    """A 4-bit checkpoint at wider shapes, in fresh processes: writing its archive and
    answering peaks below the f32 bytes of its weights (an f32 expansion alone would be
    1x; the f32 run, printed, is over 2x), and once loaded its anonymous memory is under
    0.5x the bytes of q, scales and biases: no copy of them, the archive's pages serve
    prefill and decode (`Precision.compile_flags`, as for int8: tests/test_quant.py; measured
    0.17x, 0.83x while decode's split-K q had a load-time copy)."""
    cfg = dataclasses.replace(CFG, vocab_size=8192, hidden_size=1024, intermediate_size=4096,
                              num_attention_heads=8, num_key_value_heads=4, head_dim=128, mrope_section=(24, 20, 20))
    write_mlx_text(tmp_path / "m", cfg, 4, 64)
    f32_bytes = sum(int(np.prod(s.shape)) * 4 for s in text_weights(cfg))
    stored = dataclasses.replace(cfg, native_weights=native_weights(tmp_path / "m", cfg))
    in_bits = sum(int(np.prod(s.shape)) * {"i4": 0.5, "f32": 4}[s.dtype] for s in text_weights(stored))
    runs = {p: [measure(tmp_path / "m", tmp_path / "cache", p) for _ in range(2)] for p in ("mlx", "f32")}
    for p, (first, second) in runs.items():
        print(f"{p}: peak RSS {first['peak'] / f32_bytes:.2f}x the f32 weights writing the archive, "
              f"{second['peak'] / f32_bytes:.2f}x from the cache; resident once loaded "
              f"{second['loaded'] / in_bits:.2f}x the weights in their bits; archive {first['archive'] / 1e6:.0f} MB")
    mlx = runs["mlx"]
    assert max(r["peak"] for r in mlx) < f32_bytes, mlx
    assert mlx[1]["loaded"] < 0.5 * in_bits, (mlx, in_bits)
    assert mlx[0]["archive"] < 1.05 * in_bits + 65536


@pytest.mark.parametrize("bits", [4, 8])
def test_recentred_weights_are_mx_dequantize(bits):
    """q = u - 2^(bits-1) and bias + 2^(bits-1)*scale (quant.from_affine, in row blocks of
    3 here) give mx.dequantize's weight to f32 rounding; the stored q is q transposed."""
    from runtime.checkpoints.mlx_quant import unpack_bytes

    w = np.random.default_rng(bits).standard_normal((10, 128)).astype(np.float32)
    packed, scales, biases = mx.quantize(mx.array(w), group_size=64, bits=bits)
    theirs = np.array(mx.dequantize(packed, scales, biases, group_size=64, bits=bits), np.float32)
    codes = unpack_bytes(np.array(packed), bits)
    stored, s, b = quant.from_affine(quant.row_blocks(codes, 4), (10, 128), np.array(scales), np.array(biases), bits)
    q = (codes.astype(np.int16) - (1 << (bits - 1))).astype(np.int8)
    expected = quant.nibbles(np.ascontiguousarray(q.T)) if bits == 4 else q.T
    np.testing.assert_array_equal(stored, expected)
    ours = quant.dequantize(q, s, 64, b)
    assert rel_l2(ours, theirs) < 1e-6 and np.abs(ours - theirs).max() <= 1e-6 * np.abs(theirs).max()


def quantize_text_in_place(folder, bits: int, group: int) -> None:
    """A generation checkpoint's language model re-stored by mx.quantize in mlx-vlm's names
    (the vision tower left as it is), config.json given mlx-vlm's `quantization` block."""
    from safetensors.numpy import load_file

    arrays = {}
    for name, w in load_file(str(folder / "model.safetensors")).items():
        if not (name.startswith(TEXT_PREFIX) or name == LM_HEAD):
            arrays[name] = mx.array(w)
            continue
        key = stored_name(name)
        if w.ndim != 2:
            arrays[key] = mx.array(w)
            continue
        packed, scales, biases = mx.quantize(mx.array(w), group_size=group, bits=bits)
        module = key[: -len(".weight")]
        arrays.update({key: packed, module + ".scales": scales, module + ".biases": biases})
    mx.save_safetensors(str(folder / "model.safetensors"), arrays, metadata={"format": "mlx"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization"] = {"group_size": group, "bits": bits, "mode": "affine"}
    (folder / "config.json").write_text(json.dumps(config))


def test_generate_mlx_from_the_command_line(tmp_path):
    """`qwen3vl generate --precision mlx` with an image on a 4-bit MLX checkpoint (the vision
    tower in f32 beside it): every step's logits within relL2 1e-5 of `--precision f32`'s
    (which expands the same weights at load); with no --precision it runs as mlx."""
    from helpers import generate_logits, write_images
    from emitter.config import PRESETS
    from runtime.checkpoints.synthetic import DEFAULT_PROCESSOR
    from runtime.checkpoints.synthetic_text import write_generation_checkpoint

    policy = dict(DEFAULT_PROCESSOR, size={"shortest_edge": 4096, "longest_edge": 32768})
    write_generation_checkpoint(tmp_path / "m", dataclasses.replace(PRESETS["tiny"], out_hidden_size=128),
                                dataclasses.replace(CFG, vocab_size=512), seed=3, processor_policy_dict=policy)
    quantize_text_in_place(tmp_path / "m", 4, 64)
    (image,) = write_images(tmp_path, ((64, 64),))
    logits = {p: generate_logits(tmp_path / "m", image, p, tmp_path / "cache", tmp_path, 3)
              for p in ("mlx", "f32", None)}
    np.testing.assert_array_equal(logits[None], logits["mlx"])  # the default for such a checkpoint
    assert logits["mlx"].shape == logits["f32"].shape
    errors = [rel_l2(a, b) for a, b in zip(logits["mlx"], logits["f32"])]
    assert max(errors) <= TOL, errors


def test_bits_that_disagree_with_the_config_are_one_line(tmp_path):
    """A 4-bit checkpoint whose config.json says 8 bits: refused naming the tensor and the
    stored shapes, before anything is compiled."""
    folder = tmp_path / "m"
    write_mlx_text(folder, CFG, 4, 64)
    config = json.loads((folder / "config.json").read_text())
    config["quantization"]["bits"] = 8
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"^language_model\.model\.embed_tokens\.weight: stored shapes "
                                              r"\[384, 16\], \[384, 2\], \[384, 2\] do not pack a \[384, 128\] "
                                              r"weight at 8 bits, group 64"):
        TextSession(folder, buckets=(32,), context=64, cache_dir=tmp_path / "cache", precision="mlx")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.vmfb"))


@pytest.mark.parametrize("bits, group, intermediate", [(8, 32, 128), (4, 64, 128), (4, 64, 208)])
def test_vision_tower_in_its_bits(tmp_path, bits, group, intermediate):
    """An MLX-quantized tower's linears in their bits (`--precision mlx`: the position table
    expanded): its outputs within relL2 1e-5 of the f32 session over the same folder (the
    same weights dequantized at load), its archive holding the linears in i8 / i4; a 4-bit
    fc1 of 208 outputs (as the 8B's of 4304: IREE cannot compile it in i4) held in i8."""
    from PIL import Image

    from emitter.config import PRESETS
    from emitter.vision import graph_weights
    from runtime.checkpoints.synthetic import DEFAULT_PROCESSOR, write_checkpoint
    from runtime.vision import VisionSession

    policy = dict(DEFAULT_PROCESSOR, size={"shortest_edge": 4096, "longest_edge": 32768})
    write_checkpoint(tmp_path / "m", dataclasses.replace(PRESETS["tiny"], intermediate_size=intermediate), seed=2,
                     layout="mlx", bits=bits, group_size=group, processor_policy_dict=policy)
    rng = np.random.default_rng(3)
    images = [Image.fromarray(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8))]
    sessions = {p: VisionSession(tmp_path / "m", buckets=(64,), cache_dir=tmp_path / "cache", precision=p)
                for p in ("mlx", "f32")}
    ours, reference = (sessions[p].encode(images) for p in ("mlx", "f32"))
    errors = [rel_l2(ours.image_embeds, reference.image_embeds)]
    errors += [rel_l2(a, b) for a, b in zip(ours.deepstack_features, reference.deepstack_features)]
    assert max(errors) <= TOL, errors
    cfg = sessions["mlx"].cfg
    specs = {s.name: s for s in graph_weights(cfg)}
    held = {n: quant.STORAGE_DTYPE[8 if bits == 8 or specs[n].shape[1] % 64 else 4] for n, _, _ in cfg.native_weights}
    assert cfg.native_weights and all(specs[n].dtype == held[n] for n in held)
    assert held["model.visual.blocks.0.mlp.linear_fc1.weight"] == ("i8" if bits == 8 or intermediate == 208 else "i4")
    assert not any(n.endswith("pos_embed.weight") for n, _, _ in cfg.native_weights)
    sizes = {p: s.archive_path.stat().st_size for p, s in sessions.items()}
    assert sizes["mlx"] < 0.6 * sizes["f32"], sizes
