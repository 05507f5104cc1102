"""MLX mixture-of-experts checkpoints (qwen3_vl_moe as mlx-vlm stores it: each layer's experts
as switch_mlp stacks per projection, [E, out, in], float or affine-quantized by mx.quantize, the
router `mlp.gate` at 8 bits in groups of 64, mlx-vlm's quant_predicate).

A Hugging Face tiny-moe checkpoint (64 wide, so that groups of 32 and 64 divide every width)
converted by mlx-vlm's own sanitize gives the Hugging Face folder's greedy tokens and logits;
quantized by mx.quantize at 4 and 8 bits it runs in its bits (`--precision native`: the expert
stacks' q, scales and biases in the archive, dequantized in the graph) within relL2 1e-5 of the
f32 session over the same folder, whose weights are mx.dequantize's bit for bit; a lane of the
batched module equals generate's logits bit for bit; bad expert tensors are one line. The
random writer (`qwen3vl random-checkpoint --layout mlx`, runtime/checkpoints/synthetic_mlx.py)
writes folders mlx-vlm's own loader takes (strict), whose experts read back as mx.dequantize's."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import rel_l2
from test_long_prompts import ours
from test_text_parity import SMALL_POLICY
from emitter import quant
from emitter.config import PRESETS
from emitter.experts import DOWN, GATE_UP, ROUTER
from emitter.text import text_weights, weight_shapes
from emitter.text_config import LM_HEAD, TEXT_PREFIX, TEXT_PRESETS
from runtime.checkpoints.synthetic_mlx import stored_name, write_mlx_generation_checkpoint
from runtime.checkpoints.synthetic_text import write_generation_checkpoint
from runtime.checkpoints.tensor_files import CheckpointError
from runtime.checkpoints.text import load_text_weights, native_weights
from runtime.generator import Generator
from runtime.text import TextSession

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_vlm")
pytestmark = pytest.mark.parity  # quantized by mlx, named by mlx-vlm's sanitize, loaded by mlx-vlm

TEXT = dataclasses.replace(TEXT_PRESETS["tiny-moe"], hidden_size=64, moe_intermediate_size=96, intermediate_size=128)
VISION = dataclasses.replace(PRESETS["tiny"], out_hidden_size=64)
ROUTER_SETTINGS = {"group_size": 64, "bits": 8}  # mlx-vlm's qwen3_vl_moe quant_predicate
GROUP = 32
TOL = 1e-5
SPARSE = [n for n in range(TEXT.num_hidden_layers) if TEXT.sparse(n)]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("mlx-moe")


@pytest.fixture(scope="module")
def hf(root):
    """tiny-moe at 64 wide in the Hugging Face layout (f32, experts [E, in, out] as released)."""
    write_generation_checkpoint(root / "hf", VISION, TEXT, seed=3, processor_policy_dict=SMALL_POLICY)
    return root / "hf"


def mlx_vlm_folder(hf, folder, bits: int | None, chosen=lambda key: True) -> dict:
    """`hf` with its language model as mlx-vlm stores it: renamed and split by mlx-vlm's own
    sanitize (its Model's, then its LanguageModel's: `language_model.model.*`, switch_mlp
    stacks), and with `bits` quantized by mx.quantize as mlx-vlm's convert does (every weight
    whose inputs the group divides; the routers at 8 bits in groups of 64, a per-module entry
    of config.json's `quantization`; only the stored names `chosen` takes, the others as a
    module mlx-vlm's predicate leaves float: `false` in the block); the vision tower left as
    it is. Returns {Hugging Face
    name: mx.dequantize's f32 weight} of the quantized ones (the expert stacks as the graph
    takes them: gate_proj's rows, then up_proj's)."""
    from safetensors.numpy import load_file
    from mlx_vlm.models.qwen3_vl_moe.language import LanguageModel
    from mlx_vlm.models.qwen3_vl_moe.qwen3_vl_moe import Model

    shutil.copytree(hf, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    text = {k: mx.array(v) for k, v in tensors.items() if k.startswith(TEXT_PREFIX) or k == LM_HEAD}
    arrays = {k: mx.array(v) for k, v in tensors.items() if k not in text}
    text = Model.sanitize(None, text)
    args = SimpleNamespace(num_hidden_layers=TEXT.num_hidden_layers, num_experts=TEXT.num_experts)
    text = LanguageModel.sanitize(SimpleNamespace(args=args), text)
    assert f"language_model.model.layers.{SPARSE[0]}.mlp.switch_mlp.up_proj.weight" in text
    config = json.loads((folder / "config.json").read_text())
    quantization = {"group_size": GROUP, "bits": bits, "mode": "affine"}
    dequantized = {}
    for key, w in text.items():
        module = key[: -len(".weight")]
        settings = ROUTER_SETTINGS if key.endswith(ROUTER) else {"group_size": GROUP, "bits": bits}
        if bits is None or w.ndim < 2 or w.shape[-1] % settings["group_size"]:
            arrays[key] = w
            continue
        if not chosen(key):
            arrays[key], quantization[module] = w, False
            continue
        packed, scales, biases = mx.quantize(w, **settings)
        arrays.update({key: packed, module + ".scales": scales, module + ".biases": biases})
        dequantized[key] = np.array(mx.dequantize(packed, scales, biases, **settings), np.float32)
        if key.endswith(ROUTER):
            quantization[module] = dict(settings)
    (folder / "model.safetensors").unlink()
    mx.save_safetensors(str(folder / "model.safetensors"), arrays, metadata={"format": "mlx"})
    if bits is not None:
        config["quantization"] = config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    return graph_weights(dequantized)


def graph_weights(stored: dict) -> dict:
    """{Hugging Face name: f32 weight} of weights keyed by mlx-vlm's stored names (the switch_mlp
    stacks joined: gate rows, then up rows)."""
    out = {}
    for name, shape in weight_shapes(TEXT):
        key = stored_name(name)
        if key in stored:
            out[name] = stored[key]
        elif name.endswith((GATE_UP, DOWN)):
            prefix = key[: key.index("mlp.") + len("mlp.")] + "switch_mlp."
            parts = ["gate_proj", "up_proj"] if name.endswith(GATE_UP) else ["down_proj"]
            if all(f"{prefix}{p}.weight" in stored for p in parts):
                out[name] = np.concatenate([stored[f"{prefix}{p}.weight"] for p in parts], axis=1)
                assert out[name].shape == shape
    return out


@pytest.fixture(scope="module")
def float_mlx(hf, root):
    mlx_vlm_folder(hf, root / "float", None)
    return root / "float"


@pytest.fixture(scope="module", params=[4, 8])
def quantized(request, hf, root):
    folder = root / f"mlx{request.param}"
    expected = mlx_vlm_folder(hf, folder, request.param)
    return folder, request.param, expected


def answer(model_dir, cache, precision: str, steps: int = 4, **options) -> tuple[np.ndarray, TextSession]:
    """Logits of a 37-token prompt (a 32-row chunk: every expert dequantized per call; the last
    row) and of `steps` greedy decode steps (the chosen experts gathered), [1 + steps, vocab]."""
    session = TextSession(model_dir, buckets=(32,), context=64, cache_dir=cache, precision=precision, **options)
    n = 37
    rows = [session.prefill(np.arange(n) * 7 % TEXT.vocab_size, np.broadcast_to(np.arange(n), (3, n)))]
    for step in range(steps):
        rows.append(session.decode(int(np.argmax(rows[-1])), n + step))
    return np.stack(rows), session


def test_float_mlx_layout_answers_as_the_hugging_face_one(hf, float_mlx, root):
    """The same f32 weights under mlx-vlm's names and switch_mlp stacks: the same greedy tokens
    and logits as the Hugging Face folder (relL2 <= 1e-5; measured 0, the same numbers)."""
    assert not (load_text_weights(float_mlx, TEXT).keys() ^ load_text_weights(hf, TEXT).keys())
    for name, w in load_text_weights(hf, TEXT).items():
        np.testing.assert_array_equal(load_text_weights(float_mlx, TEXT)[name], w, err_msg=name)
    theirs, _ = answer(hf, root / "cache", "f32")
    mine, _ = answer(float_mlx, root / "cache", "f32")
    errors = [rel_l2(a, b) for a, b in zip(mine, theirs)]
    print(f"float MLX layout against Hugging Face: relL2 {max(errors):.1e}")
    assert mine.argmax(axis=1).tolist() == theirs.argmax(axis=1).tolist()
    assert max(errors) <= TOL, errors


def test_the_f32_reader_is_mx_dequantize(quantized):
    """Every quantized weight (the expert stacks joined from their switch_mlp parts, the router)
    read to f32 is mx.dequantize's bit for bit; in its bits: each stack one weight of the
    checkpoint's bits and group, the router 8 bits in groups of 64."""
    folder, bits, expected = quantized
    weights = load_text_weights(folder, TEXT)
    assert {n for n in expected if n.endswith((GATE_UP, DOWN))} == {
        f"{TEXT_PREFIX}layers.{n}.{s}" for n in SPARSE for s in (GATE_UP, DOWN)}
    for name, theirs in expected.items():
        np.testing.assert_array_equal(weights[name].view(np.uint32), theirs.view(np.uint32), err_msg=name)
    layouts = {name: (b, g) for name, b, g in native_weights(folder, TEXT)}
    assert set(layouts) == set(expected)
    for n in SPARSE:
        prefix = f"{TEXT_PREFIX}layers.{n}."
        assert layouts[prefix + GATE_UP] == layouts[prefix + DOWN] == (bits, GROUP)
        assert layouts[prefix + ROUTER] == (8, 64)


@pytest.fixture(scope="module")
def in_its_bits(quantized, root):
    folder, bits, _ = quantized
    ours_, session = answer(folder, root / "cache", "native")
    reference, _ = answer(folder, root / "cache", "f32")
    return ours_, reference, session


def test_in_its_bits_equals_f32_over_mx_dequantize(quantized, in_its_bits):
    """The session in its bits (the expert stacks dequantized in the graph: every expert per call
    for the prompt chunks, the chosen experts alone in decode) against the f32 session over the
    same folder (mx.dequantize's weights): relL2 <= 1e-5, the same greedy tokens."""
    _, bits, _ = quantized
    mine, reference, _ = in_its_bits
    errors = [rel_l2(a, b) for a, b in zip(mine, reference)]
    print(f"{bits}-bit experts in their bits against f32 over mx.dequantize: relL2 {max(errors):.1e}")
    assert mine.argmax(axis=1).tolist() == reference.argmax(axis=1).tolist()
    assert max(errors) <= TOL, errors


def test_the_archive_holds_the_experts_in_their_bits(quantized, in_its_bits):
    """The archive's expert stacks are q in i4 / i8 ([E, in, out]) with f32 scales and biases
    per group, the routers q in i8; no f32 tensor of an expert stack's size is written, and
    the archive is under 0.4x the f32 one."""
    _, bits, _ = quantized
    _, _, session = in_its_bits
    specs = {s.name: s for s in text_weights(session.cfg, session.precision)}
    stack = TEXT.num_experts * 2 * TEXT.moe_intermediate_size * TEXT.hidden_size
    for n in SPARSE:
        prefix = f"{TEXT_PREFIX}layers.{n}."
        for name in (GATE_UP, DOWN):
            e, out, n_in = dict(weight_shapes(TEXT))[prefix + name]
            assert specs[prefix + name].dtype == quant.STORAGE_DTYPE[bits]
            assert specs[prefix + name].shape == (e, n_in, out)
            assert specs[quant.scales_name(prefix + name)].dtype == specs[quant.biases_name(prefix + name)].dtype \
                == "f32"
        assert specs[prefix + ROUTER].dtype == "i8"
    assert max(int(np.prod(s.shape)) for s in specs.values() if s.dtype == "f32") < stack / 8
    f32 = sum(int(np.prod(shape)) * 4 for _, shape in weight_shapes(TEXT))
    size = session.archive_path.stat().st_size
    print(f"{bits}-bit archive {size / 1e3:.0f} kB, the f32 weights {f32 / 1e3:.0f} kB")
    assert size < 0.4 * f32


def test_a_lane_of_the_batched_module_is_bit_equal(quantized, root):
    """In its bits, with an image (the tower f32): generate's logits (prompt and decode steps)
    against the same prompt as a sequence of the server's two-lane module: bit for bit."""
    from helpers import write_images
    from test_long_prompts import lane_logits

    folder, bits, _ = quantized
    (image,) = write_images(root, ((64, 96),), seed=bits, stem=f"lane{bits}-")
    gen = Generator(folder, buckets=(32, 64), context=160, cache_dir=root / "cache", precision="native")
    chat = [{"role": "user", "content": [{"type": "image", "image": image},
                                         {"type": "text", "text": "Describe the picture: what is shown here?"}]}]
    prompt, tokens, logits = ours(gen, chat, 4)
    batch = TextSession(folder, (32, 64), 160, len(VISION.deepstack_visual_indexes), cache_dir=root / "cache",
                        lanes=2, precision="native")
    assert batch.cfg.native_weights == gen.text.cfg.native_weights
    assert lane_logits(batch, prompt, tokens[:3]) == [x.tobytes() for x in logits[:4]]


def two_lanes(session, prompts, steps: int = 3) -> list[list[np.ndarray]]:
    """Each prompt's logits (prefill, then `steps` greedy decode steps), the sequences decoded
    together (`decode_batch`: one call of decode_<len(prompts)> a step)."""
    seqs, out = [], []
    for p in prompts:
        seq, start = session.admit(p)
        seqs.append(seq)
        out.append([session.prefill_blocks(seq, p, start)])
    for step in range(steps):
        lengths = [p.ids.size + step for p in prompts]
        assert all(session.grow(seq, n + 1) for seq, n in zip(seqs, lengths))
        rows = session.decode_batch(seqs, [int(np.argmax(o[-1])) for o in out], lengths, lengths)
        for o, row in zip(out, rows):
            o.append(row)
    for seq in seqs:
        session.release(seq)
    return out


def test_gathered_experts_of_two_lanes_are_each_alone(hf, root):
    """The expert stacks (4-bit) and routers (8-bit) in their bits, the other weights float: a
    sequence decoded beside another (decode_2: both lanes' chosen experts gathered and
    dequantized in one call) gives its logits alone bit for bit. (The dense projections' split-K
    form of an MLX checkpoint is not lane for lane equal at 2 rows, measured ~5e-7 apart
    before this change: so they stay float here.)"""
    from runtime.inputs.chat import Prompt

    folder = root / "experts4"
    mlx_vlm_folder(hf, folder, 4, chosen=lambda key: "switch_mlp" in key or key.endswith(ROUTER))
    assert {n.rsplit(".", 1)[-1] for n, _, _ in native_weights(folder, TEXT)} == {
        "gate_up_proj", "down_proj", "weight"}
    prompts = [Prompt(ids, np.broadcast_to(np.arange(ids.size), (3, ids.size)).copy(), 0)
               for ids in (np.arange(37) * 7 % TEXT.vocab_size, np.arange(20) * 11 % TEXT.vocab_size)]
    options = dict(buckets=(32,), context=64, cache_dir=root / "cache", precision="native")
    (alone,) = two_lanes(TextSession(folder, **options), prompts[:1])
    beside, _ = two_lanes(TextSession(folder, lanes=2, **options), prompts)
    assert [x.tobytes() for x in beside] == [x.tobytes() for x in alone]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_nothing_is_expanded_to_f32(tmp_path):
    """A 4-bit mixture of experts at wider shapes (32 experts of 512 over 1024 wide, 4 chosen),
    in fresh processes: writing its archive and answering peak below the f32 bytes of its
    weights, and once loaded its anonymous memory is under 0.5x the bytes of q, scales and
    biases (no copy of the experts at load: decode reads the chosen experts' bytes, a prompt
    chunk dequantizes per call); the archive is the weights in their bits. (Measured: peak
    0.44x the f32 bytes, loaded 0.06x the bytes in their bits; after a 40-token prompt and a
    decode step 1.77x, IREE's transient pool keeping one layer's experts dequantized.)"""
    from runtime.bench.mlx_memory import measure

    cfg = dataclasses.replace(TEXT, vocab_size=4096, hidden_size=1024, intermediate_size=2048,
                              moe_intermediate_size=512, num_experts=32, num_experts_per_tok=4, mlp_only_layers=(),
                              num_attention_heads=8, num_key_value_heads=4, head_dim=128, mrope_section=(24, 20, 20))
    write_mlx_generation_checkpoint(tmp_path / "m", dataclasses.replace(VISION, out_hidden_size=1024), cfg, bits=4,
                                    group_size=64, seed=1)
    f32_bytes = sum(int(np.prod(s.shape)) * 4 for s in text_weights(cfg))
    stored = dataclasses.replace(cfg, native_weights=native_weights(tmp_path / "m", cfg))
    in_bits = sum(int(np.prod(s.shape)) * {"i4": 0.5, "i8": 1, "f32": 4}[s.dtype] for s in text_weights(stored))
    runs = [measure(tmp_path / "m", tmp_path / "cache", "native") for _ in range(2)]
    for run in runs:
        print(f"peak RSS {run['peak'] / f32_bytes:.2f}x the f32 weights; resident once loaded "
              f"{run['loaded'] / in_bits:.2f}x the weights in their bits, after an answer "
              f"{run['answered'] / in_bits:.2f}x; archive {run['archive'] / 1e6:.0f} MB")
    assert max(r["peak"] for r in runs) < f32_bytes, runs
    assert runs[1]["loaded"] < 0.5 * in_bits, (runs, in_bits)
    assert runs[0]["archive"] < 1.05 * in_bits + 65536


def restored(folder, edit) -> None:
    """The folder's shard re-stored with `edit(tensors)` applied."""
    from safetensors.numpy import load_file, save_file
    (shard,) = folder.glob("*.safetensors")
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "mlx"})


@pytest.mark.parametrize("case", ["packed-shape", "forms", "missing"])
def test_bad_quantized_experts_are_one_line(hf, tmp_path, case):
    """A switch_mlp stack whose words do not pack its shape, a gate_proj and up_proj in different
    bits, or a missing part: one line naming the tensor, before anything is compiled."""
    folder = tmp_path / "m"
    mlx_vlm_folder(hf, folder, 4)
    layer = f"language_model.model.layers.{SPARSE[0]}.mlp.switch_mlp."
    e, d, i = TEXT.num_experts, TEXT.hidden_size, TEXT.moe_intermediate_size

    def edit(tensors):
        if case == "packed-shape":
            tensors[layer + "up_proj.weight"] = np.zeros((e, i, d * 4 // 32 - 1), np.uint32)
        elif case == "forms":
            w = np.random.default_rng(0).standard_normal((e, i, d)).astype(np.float32)
            packed, scales, biases = mx.quantize(mx.array(w), group_size=GROUP, bits=8)
            tensors.update({layer + "gate_proj.weight": np.array(packed), layer + "gate_proj.scales": np.array(scales),
                            layer + "gate_proj.biases": np.array(biases)})
        else:
            for part in ("weight", "scales", "biases"):
                del tensors[layer + "up_proj." + part]

    restored(folder, edit)
    if case == "forms":  # config.json gives the gate stack its bits
        config = json.loads((folder / "config.json").read_text())
        config["quantization"][layer + "gate_proj"] = {"group_size": GROUP, "bits": 8}
        (folder / "config.json").write_text(json.dumps(config))
    expect = {
        "packed-shape": rf"^{layer}up_proj\.weight: stored shapes \[{e}, {i}, 7\], \[{e}, {i}, 2\], \[{e}, {i}, 2\] "
                        rf"do not pack a \[{e}, {i}, {d}\] weight at 4 bits, group 32",
        "forms": rf"^{TEXT_PREFIX}layers\.{SPARSE[0]}\.mlp\.experts\.gate_up_proj: its parts are stored in different "
                 rf"forms \({layer}gate_proj\.weight 8-bit groups of 32, {layer}up_proj\.weight 4-bit groups of 32\)",
        "missing": rf"^{layer}up_proj\.weight: missing",
    }[case]
    with pytest.raises(CheckpointError, match=expect) as raised:
        TextSession(folder, buckets=(32,), context=64, cache_dir=tmp_path / "cache", precision="native")
    assert "\n" not in str(raised.value)
    if case == "forms":  # f32 reads each part in its own bits
        assert load_text_weights(folder, TEXT)[f"{TEXT_PREFIX}layers.{SPARSE[0]}.{GATE_UP}"].shape == (e, 2 * i, d)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.vmfb"))


def mlx_vlm_load(folder):
    """The folder loaded by mlx-vlm's own loader (strict: every tensor it expects, of its shape
    and quantization, and no other)."""
    from mlx_vlm.utils import load_model
    return load_model(folder, lazy=False, strict=True)


@pytest.mark.parametrize("bits", [None, 4, 8])
def test_the_writer_writes_what_mlx_vlm_loads(tmp_path, bits):
    """`write_mlx_generation_checkpoint` of a mixture of experts: mlx-vlm's loader takes it whole
    (names, shapes, the quantization block: switch_mlp stacks at `bits`, the routers at 8 bits
    in groups of 64), and the f32 reader's experts are mlx-vlm's own modules dequantized by
    mx.dequantize (gate_proj's rows, then up_proj's), bit for bit."""
    import mlx.nn as nn

    folder = tmp_path / "m"
    write_mlx_generation_checkpoint(folder, VISION, TEXT, bits=bits, group_size=GROUP, seed=4)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl_moe"
    model = mlx_vlm_load(folder)
    weights = load_text_weights(folder, TEXT)
    for n in SPARSE:
        mlp = model.language_model.model.layers[n].mlp
        parts = {}
        for part in ("gate_proj", "up_proj", "down_proj"):
            linear = getattr(mlp.switch_mlp, part)
            assert (getattr(linear, "bits", None), getattr(linear, "group_size", None)) == (
                (bits, GROUP) if bits else (None, None))
            parts[part] = (linear.weight if bits is None else
                           mx.dequantize(linear.weight, linear.scales.astype(mx.float32),
                                         linear.biases.astype(mx.float32), group_size=GROUP, bits=bits))
            parts[part] = np.array(parts[part].astype(mx.float32), np.float32)
        prefix = f"{TEXT_PREFIX}layers.{n}."
        np.testing.assert_array_equal(weights[prefix + GATE_UP],
                                      np.concatenate([parts["gate_proj"], parts["up_proj"]], axis=1))
        np.testing.assert_array_equal(weights[prefix + DOWN], parts["down_proj"])
        assert isinstance(mlp.gate, nn.QuantizedLinear) == (bits is not None)
        if bits:
            assert (mlp.gate.bits, mlp.gate.group_size) == (8, 64)
            assert config["quantization"][f"language_model.model.layers.{n}.mlp.gate"] == ROUTER_SETTINGS
    if bits:
        assert {(b, g) for name, b, g in native_weights(folder, TEXT) if name.endswith((GATE_UP, DOWN))} == {
            (bits, GROUP)}


def test_random_checkpoint_command_writes_a_moe_folder(tmp_path):
    """`qwen3vl random-checkpoint --preset tiny-moe --with-text --layout mlx --bits 4`: a
    qwen3_vl_moe folder mlx-vlm loads, its experts as switch_mlp stacks (at 48 wide groups of
    64 divide no text width: as mlx-vlm's convert, they stay float)."""
    main = [sys.executable, "-c", "from runtime.commands.main import main; main()"]
    done = subprocess.run([*main, "random-checkpoint", str(tmp_path / "m"), "--preset", "tiny-moe", "--with-text",
                           "--layout", "mlx", "--bits", "4"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl_moe" and config["quantization"]["bits"] == 4
    model = mlx_vlm_load(tmp_path / "m")
    assert model.language_model.model.layers[0].mlp.switch_mlp.gate_proj.weight.shape == (
        TEXT_PRESETS["tiny-moe"].num_experts, TEXT_PRESETS["tiny-moe"].moe_intermediate_size,
        TEXT_PRESETS["tiny-moe"].hidden_size)
    assert load_text_weights(tmp_path / "m", TEXT_PRESETS["tiny-moe"])
