"""Random checkpoints in mlx-vlm's quantized layout drawn in their bits
(runtime/checkpoints/synthetic_mlx.py, `qwen3vl random-checkpoint --with-text --layout mlx
--bits`): they read back through the project's MLX readers with every linear in its bits and
the spread of the f32 recipes, are written holding about one tensor, and answer through
`qwen3vl generate` in their bits as the f32 expansion of the same folder does."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import rel_l2
from emitter.config import PRESETS, weight_schema
from emitter.text import weight_shapes
from emitter.text_config import TEXT_PRESETS
from runtime.checkpoints.synthetic import DEFAULT_PROCESSOR
from runtime.checkpoints.synthetic_mlx import write_mlx_generation_checkpoint
from runtime.checkpoints.text import load_text_weights, native_weights
from runtime.checkpoints.tensor_files import INDEX_NAME
from runtime.checkpoints.vision import load_vision_weights, vision_native_weights

# Widths that groups of 64 divide, the tiny tower's output the language model's width.
TEXT = dataclasses.replace(TEXT_PRESETS["tiny"], hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, mrope_section=(6, 5, 5),
                           vocab_size=512)
VISION = dataclasses.replace(PRESETS["tiny"], out_hidden_size=128)
TOL = 1e-5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("synthetic-mlx") / "m"
    write_mlx_generation_checkpoint(folder, VISION, TEXT, bits=4, group_size=64, seed=5, shard_bytes=1 << 16)
    return folder


def test_every_linear_in_its_bits_with_the_recipes_spread(folder):
    """Sharded (an index naming every tensor), every 2-D weight stored in 4 bits at groups of
    64 as config.json says, and expanded (`mlx_quant.dequantize_mlx`, the readers' f32 path)
    each has mean about 0 and the std of its f32 recipe: 1 for the embedding table,
    gain/sqrt(fan_in) for a projection, 0.5 for the position table."""
    index = json.loads((folder / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((folder / "config.json").read_text())["quantization"] == {
        "group_size": 64, "bits": 4, "mode": "affine"}
    text_matrices = {n for n, s in weight_shapes(TEXT) if len(s) == 2}
    assert {(n, b, g) for n, b, g in native_weights(folder, TEXT)} == {(n, 4, 64) for n in text_matrices}
    vision = vision_native_weights(folder, VISION)
    assert len(vision) == 4 * VISION.depth + 2 * (1 + len(VISION.deepstack_visual_indexes))
    weights = load_text_weights(folder, TEXT) | load_vision_weights(folder, VISION)
    shapes = dict(weight_shapes(TEXT)) | dict(weight_schema(VISION))
    for name in text_matrices | {n for n, _, _ in vision} | {"model.visual.pos_embed.weight"}:
        w = weights[name]
        assert w.shape == shapes[name]
        gain = 0.5 if name.endswith(("o_proj.weight", "down_proj.weight", "attn.proj.weight",
                                     "mlp.linear_fc2.weight")) else 1.0
        std = {"embed_tokens": 1.0, "pos_embed": 0.5}.get(name.split(".")[-2], gain / np.sqrt(w.shape[1]))
        assert abs(w.mean()) < 0.05 * std and abs(w.std() / std - 1) < 0.1, (name, w.mean(), w.std(), std)


def test_written_a_tensor_at_a_time(tmp_path):
    """The 8B's widths (6 layers, a small vocabulary: about 0.8 GB of shards) written by a
    fresh process whose peak RSS grows by less than a third of that: no shard, let alone
    the whole, is held in memory."""
    code = ("import sys, dataclasses\n"
            "from emitter.config import PRESETS\n"
            "from emitter.text_config import TEXT_PRESETS\n"
            "from runtime.checkpoints.synthetic_mlx import write_mlx_generation_checkpoint\n"
            "def rss(key):\n"
            "    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(key)) * 1024\n"
            "start = rss('VmRSS:')\n"
            "text = dataclasses.replace(TEXT_PRESETS['qwen3-vl-8b'], num_hidden_layers=6, vocab_size=1024)\n"
            "vision = dataclasses.replace(PRESETS['qwen3-vl-8b'], depth=2, deepstack_visual_indexes=(0, 1))\n"
            "write_mlx_generation_checkpoint(sys.argv[1], vision, text)\n"
            "print(rss('VmHWM:') - start)\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    written = sum(p.stat().st_size for p in (tmp_path / "m").glob("*.safetensors"))
    assert written > 0.7e9
    assert int(done.stdout.split()[-1]) < written / 3, (done.stdout, written)


def test_generate_in_its_bits_from_the_command_line(tmp_path):
    """`qwen3vl random-checkpoint --with-text --layout mlx --bits 4` on a preset writes a
    folder `qwen3vl generate` answers from; on the small widths above, with an image, the
    logits of each step in their bits (the default for it: tower and language model) within
    relL2 1e-5 of `--precision f32`'s, which expands the same codes at load."""
    from helpers import generate_logits, write_images

    main = [sys.executable, "-c", "from runtime.commands.main import main; main()"]
    done = subprocess.run([*main, "random-checkpoint", str(tmp_path / "cli"), "--preset", "tiny", "--with-text",
                           "--layout", "mlx", "--dtype", "bf16", "--bits", "4", "--group-size", "32"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "mlx, bf16, 4-bit groups of 32" in done.stdout
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["quantization"]["group_size"] == 32

    policy = dict(DEFAULT_PROCESSOR, size={"shortest_edge": 4096, "longest_edge": 32768})
    write_mlx_generation_checkpoint(tmp_path / "m", VISION, TEXT, bits=4, group_size=64, seed=1)
    (tmp_path / "m" / "preprocessor_config.json").write_text(json.dumps(policy))
    (image,) = write_images(tmp_path, ((64, 64),))
    logits = {p: generate_logits(tmp_path / "m", image, p, tmp_path / "cache", tmp_path, 3) for p in (None, "f32")}
    assert logits[None].shape == logits["f32"].shape == (3, TEXT.vocab_size)
    errors = [rel_l2(a, b) for a, b in zip(logits[None], logits["f32"])]
    assert max(errors) <= TOL, errors


def test_bad_arguments_are_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^bits 3: expected 4 or 8$"):
        write_mlx_generation_checkpoint(tmp_path / "m", VISION, TEXT, bits=3)
    with pytest.raises(ValueError, match=r"^text hidden_size 48 != vision out_hidden_size 128$"):
        write_mlx_generation_checkpoint(tmp_path / "m", VISION, TEXT_PRESETS["tiny"])
    assert not (tmp_path / "m").exists()
