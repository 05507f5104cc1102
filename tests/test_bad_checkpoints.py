"""Checkpoint folders and configs that do not fit each other, through the CLI as
a user meets them: each a one-line error naming what is wrong, a non-zero exit, before
anything is compiled; and `random-checkpoint` writing a whole folder or nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file, save_file

from emitter.config import PRESETS, load_model_config
from helpers import exec_after
from runtime.checkpoints.tensor_files import INDEX_NAME, CheckpointError
from runtime.checkpoints.vision import check_checkpoint, load_vision_weights
from runtime.checkpoints.synthetic import DEFAULT_PROCESSOR, write_checkpoint

QWEN3VL = str(Path(sys.executable).parent / "qwen3vl")
TINY = PRESETS["tiny"]
SMALL_POLICY = dict(DEFAULT_PROCESSOR, size={"shortest_edge": 4096, "longest_edge": 32768})
QKV = "vision_tower.blocks.0.attn.qkv"


def one_line_error(result, *named: str) -> str:
    """The command failed with exit status 2 and one `error:` line (no traceback) naming
    every `named`."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in named:
        assert word in lines[0], (word, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("img") / "a.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path)
    return path


def refused(model: Path, *named: str) -> str:
    """In-process, for the variants of a case the CLI test covers: the config and the
    checkpoint's headers, matched as `qwen3vl run` matches them first, fail with one line."""
    with pytest.raises(ValueError) as err:
        check_checkpoint(model, load_model_config(model))
    msg = str(err.value)
    assert "\n" not in msg, msg
    for word in named:
        assert word in msg, (word, msg)
    return msg


def run(model, image, cache, timeout=120):
    return subprocess.run([QWEN3VL, "run", "--model", str(model), str(image), "--cache-dir", str(cache),
                           "--bucket", "64"], capture_output=True, text=True, timeout=timeout)


def edit_config(model: Path, edit) -> None:
    config = json.loads((model / "config.json").read_text())
    edit(config)
    (model / "config.json").write_text(json.dumps(config))


def edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "mlx"})


def mlx_checkpoint(folder: Path, **kw) -> Path:
    write_checkpoint(folder, TINY, seed=1, layout="mlx", bits=4, group_size=64,
                     processor_policy_dict=SMALL_POLICY, **kw)
    return folder


# --------------------------------------------------------------------------- MLX bits from the config

def test_mlx_quantized_checkpoint_runs(tmp_path, image):
    """The control for the cases below: the unedited 4-bit checkpoint runs."""
    result = run(mlx_checkpoint(tmp_path / "m"), image, tmp_path / "cache")
    assert result.returncode == 0, result.stderr
    assert "image_embeds [4, 48]" in result.stdout


def test_mlx_packed_rows_cut_short(tmp_path, image):
    """6 words a row would read as 3-bit codes; the config says 4 bits: 8 words."""
    model = mlx_checkpoint(tmp_path / "m")
    edit_tensors(model / "model.safetensors", lambda t: t.update({QKV + ".weight": t[QKV + ".weight"][:, :6].copy()}))
    one_line_error(run(model, image, tmp_path / "cache"), QKV + ".weight", "stored shape [192, 6]", "4-bit",
                   "[192, 8]", "config.json")


def test_mlx_config_bits_disagree_with_tensors(tmp_path, image):
    model = mlx_checkpoint(tmp_path / "m")
    edit_config(model, lambda c: (c["quantization"].update(bits=8), c["quantization_config"].update(bits=8)))
    one_line_error(run(model, image, tmp_path / "cache"), "vision_tower.", "stored shape", "8-bit", "config.json")


def test_mlx_per_module_entry_disagrees(tmp_path, image):
    """A per-module entry (as mlx-vlm writes for mixed bits) is what that module is checked against."""
    model = mlx_checkpoint(tmp_path / "m", quant_overrides={"blocks.0.attn.qkv": {"bits": 8, "group_size": 32}})
    edit_config(model, lambda c: c["quantization"][QKV].update(bits=4))
    msg = one_line_error(run(model, image, tmp_path / "cache"), QKV + ".weight", "stored shape [192, 16]", "4-bit")
    assert repr(QKV) in msg  # names the config entry


@pytest.mark.parametrize("case,named", [
    ("module marked unquantized", ["'quantization'", "is false"]),
    ("no quantization block", ["no 'quantization' block"]),
    ("bits 7", ["bits 7"]),
    ("mode mxfp4", ["'mxfp4'", "'affine'"]),
    ("group size 48", ["group_size 48"]),
])
def test_mlx_quantization_block_errors(tmp_path, case, named):
    model = mlx_checkpoint(tmp_path / "m")

    def edit(c):
        q = c["quantization"]
        if case == "module marked unquantized":
            q[QKV] = False
        elif case == "no quantization block":
            del c["quantization"], c["quantization_config"]
        elif case == "bits 7":
            q["bits"] = 7
        elif case == "mode mxfp4":
            q["mode"] = "mxfp4"
        else:
            q["group_size"] = 48
        if "quantization" in c:
            c["quantization_config"] = q

    edit_config(model, edit)
    with pytest.raises(CheckpointError) as err:
        load_vision_weights(model, TINY)
    msg = str(err.value)
    assert "\n" not in msg and "vision_tower." in msg, msg
    for word in named:
        assert word in msg, (word, msg)


def test_mlx_unquantized_module_with_settings(tmp_path):
    """A module stored in floats, but given its own quantization entry in the config."""
    model = mlx_checkpoint(tmp_path / "m", quant_overrides={"merger.linear_fc2": False})
    edit_config(model, lambda c: c["quantization"].update({"vision_tower.merger.linear_fc2": {"bits": 8}}))
    with pytest.raises(CheckpointError, match=r"merger\.linear_fc2\.weight: stored unquantized \(F32\)"):
        load_vision_weights(model, TINY)


# --------------------------------------------------------------------------- config against the weights

def rope_model(tmp_path, rope) -> Path:
    model = tmp_path / "m"
    write_checkpoint(model, TINY, seed=1, processor_policy_dict=SMALL_POLICY)
    edit_config(model, lambda c: c["vision_config"].update(rope))
    return model


def test_negative_rope_theta(tmp_path, image):
    """It used to give all-NaN features after a numpy warning."""
    model = rope_model(tmp_path, {"rope_parameters": {"rope_type": "axial", "rope_theta": -1}})
    one_line_error(run(model, image, tmp_path / "cache"), str(model / "config.json"),
                   "'vision_config.rope_parameters.rope_theta' = -1", "finite positive number")


@pytest.mark.parametrize("rope,field", [
    ({"rope_parameters": {"rope_type": "axial", "rope_theta": 0}}, "vision_config.rope_parameters.rope_theta"),
    ({"rope_parameters": {"rope_theta": "10000"}}, "vision_config.rope_parameters.rope_theta"),
    ({"rope_parameters": {"rope_theta": float("inf")}}, "vision_config.rope_parameters.rope_theta"),
    ({"rope_theta": -1}, "vision_config.rope_theta"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000}}, "vision_config.rope_parameters.rope_type"),
    ({"rope_parameters": [10000]}, "vision_config.rope_parameters"),
])
def test_bad_rope_fields(tmp_path, rope, field):
    refused(rope_model(tmp_path, rope), str(tmp_path / "m" / "config.json"), f"'{field}'")


def test_rope_theta_read_where_transformers_reads_it(tmp_path):
    """transformers 5 reads `rope_parameters.rope_theta` and takes rope_type 'default' as axial."""
    assert load_model_config(rope_model(tmp_path / "a", {"rope_parameters": {"rope_type": "axial", "rope_theta": 5e3},
                                                         "rope_theta": -1})).rope_theta == 5e3
    assert load_model_config(rope_model(tmp_path / "b", {"rope_parameters": {"rope_type": "default",
                                                                             "rope_theta": 7e3}})).rope_theta == 7e3


def fitted_model(tmp_path, edit, **kw) -> Path:
    model = tmp_path / "m"
    write_checkpoint(model, TINY, seed=1, processor_policy_dict=SMALL_POLICY, **kw)
    edit_config(model, lambda c: c["vision_config"].update(edit))
    return model


def test_depth_that_does_not_fit_the_weights(tmp_path, image):
    """Checked from the safetensors headers before anything is sized by the config: depth 3
    no longer leaves block 3 silently unused."""
    model = fitted_model(tmp_path, dict(depth=3))
    one_line_error(run(model, image, tmp_path / "cache", timeout=60), "vision_config.depth = 3",
                   "4 blocks", "model.visual.blocks.0-3", "model.safetensors")


def test_absurd_depth_fails_at_once(tmp_path, image):
    """10**9 blocks fails the config's sanity bound at once instead of growing memory."""
    model = fitted_model(tmp_path, dict(depth=1_000_000_000))
    one_line_error(run(model, image, tmp_path / "cache", timeout=60), "depth' = 1000000000", "at most 1024")


@pytest.mark.parametrize("edit,named", [
    (dict(depth=5), ["vision_config.depth = 5", "4 blocks"]),
    (dict(deepstack_visual_indexes=[1]), ["deepstack_visual_indexes = [1]", "2 DeepStack mergers"]),
    (dict(deepstack_visual_indexes=[0, 1, 2]), ["deepstack_visual_indexes = [0, 1, 2]", "2 DeepStack mergers"]),
])
def test_config_that_does_not_fit_the_weights(tmp_path, edit, named):
    refused(fitted_model(tmp_path, edit), *named)


def add_tensors(model: Path, names) -> None:
    edit_tensors(model / "model.safetensors", lambda t: t.update({name: np.zeros(3, np.float32) for name in names}))


def test_unused_vision_tensor(tmp_path, image):
    model = fitted_model(tmp_path, {})
    add_tensors(model, ["model.visual.blocks.0.attn.extra.weight"])
    one_line_error(run(model, image, tmp_path / "cache"), "model.visual.blocks.0.attn.extra.weight",
                   "1 unused", "model.safetensors")


def test_second_layout_beside_the_first_is_unused(tmp_path):
    model = fitted_model(tmp_path, {})
    add_tensors(model, ["vision_tower.pos_embed.weight", "vision_tower.merger.norm.bias"])
    refused(model, "vision_tower.merger.norm.bias", "2 unused")


def index_pointing_to(tmp_path, shard) -> tuple[Path, str]:
    model = fitted_model(tmp_path, {}, shards=2)
    index = json.loads((model / INDEX_NAME).read_text())
    name = "model.visual.blocks.3.norm1.bias"
    index["weight_map"][name] = shard
    (model / INDEX_NAME).write_text(json.dumps(index))
    return model, name


def test_index_entry_outside_the_folder(tmp_path, image):
    model, name = index_pointing_to(tmp_path, "../../elsewhere.safetensors")
    one_line_error(run(model, image, tmp_path / "cache"), name, "'../../elsewhere.safetensors'",
                   "outside the model folder", INDEX_NAME)


@pytest.mark.parametrize("shard", ["/etc/model.safetensors", "a/../../b.safetensors", 7])
def test_index_entry_not_a_file_in_the_folder(tmp_path, shard):
    model, name = index_pointing_to(tmp_path, shard)
    refused(model, name, repr(shard))


# --------------------------------------------------------------------------- random-checkpoint

def random_checkpoint(folder, *args, setup=None):
    """`qwen3vl random-checkpoint FOLDER ARGS`, after the Python statements `setup` if given."""
    command = [QWEN3VL, "random-checkpoint", str(folder), *args]
    return subprocess.run(exec_after(setup, command) if setup else command, capture_output=True, text=True)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_random_checkpoint_refuses_a_folder_with_files(tmp_path):
    """An older sharded checkpoint stays as it was: no model.safetensors beside its stale index."""
    old = tmp_path / "m"
    write_checkpoint(old, TINY, seed=1, shards=2)
    before = snapshot(old)
    one_line_error(random_checkpoint(old, "--preset", "tiny"), str(old), "not empty", "new or empty folder")
    assert snapshot(old) == before
    (tmp_path / "file").write_text("x")
    one_line_error(random_checkpoint(tmp_path / "file"), "not a plain folder")
    (tmp_path / "empty").mkdir()
    result = random_checkpoint(tmp_path / "empty", "--layout", "mlx", "--bits", "4")
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(tmp_path / "empty")) == ["config.json", "model.safetensors",
                                                      "preprocessor_config.json", "video_preprocessor_config.json"]
    assert sorted(os.listdir(tmp_path)) == ["empty", "file", "m"]  # no temp folder left


def test_random_checkpoint_removes_a_killed_writers_temp_folder(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".m.tmp.{int(done.stdout)}.abc"  # its writer has exited
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    result = random_checkpoint(tmp_path / "m")
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["m"]


def test_random_checkpoint_failed_write_leaves_nothing(tmp_path):
    """A write that fails part way (here a file-size limit: the kernel refuses the write
    past 100 kB, as a full disk would) leaves neither the folder nor any temp behind."""
    target = tmp_path / "m"
    limit = "import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))"
    msg = one_line_error(random_checkpoint(target, setup=limit), str(target), "cannot write")
    assert ".tmp" not in msg  # named by the folder asked for, not the temp one
    assert os.listdir(tmp_path) == []


def test_random_checkpoint_on_a_full_disk_leaves_nothing(tmp_path):
    """A real full file system: a tmpfs smaller than the checkpoint (the tiny position table
    alone is 590 kB)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    root = tmp_path / "small"
    root.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(root)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        msg = one_line_error(random_checkpoint(root / "m"), str(root / "m"), "cannot write")
        assert ".tmp" not in msg
        assert os.listdir(root) == []
    finally:
        subprocess.run(["umount", str(root)])
