"""`qwen3vl export` and the one-module artifact: IREE's own iree-run-module runs the
exported folder on inputs dumped by `qwen3vl run` and reproduces its outputs; the weight
archive is content-addressed, checked against the config, and rebuilt when corrupt."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file

from conftest import rel_l2
from emitter.config import PRESETS
from emitter.vision import graph_weights
from runtime.artifact.archive import ArchiveError, open_archive, tensor_metadata, write_archive
from runtime.vision import VisionSession
from runtime.checkpoints.synthetic import DEFAULT_PROCESSOR, write_checkpoint

TINY = PRESETS["tiny"]
SMALL_POLICY = dict(DEFAULT_PROCESSOR, size={"shortest_edge": 4096, "longest_edge": 32768})
QWEN3VL = [sys.executable, "-c", "from runtime.commands.main import main; main()"]
IREE_RUN_MODULE = Path(sys.executable).parent / "iree-run-module"
BUCKETS = ("32", "64")


def qwen3vl(*args):
    return subprocess.run([*QWEN3VL, *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    write_checkpoint(root / "tiny-model", TINY, seed=3, processor_policy_dict=SMALL_POLICY)
    args = [a for b in BUCKETS for a in ("--bucket", b)]
    out = qwen3vl("export", "--model", str(root / "tiny-model"), "-o", str(root / "out"), *args,
                  "--cache-dir", str(root / "cache"))
    assert out.returncode == 0, out.stderr
    return root


def test_export_folder_and_abi(exported):
    out = exported / "out"
    assert sorted(p.name for p in out.iterdir()) == ["README.txt", "abi.json", "tiny-model.irpa", "tiny-model.vmfb"]
    abi = json.loads((out / "abi.json").read_text())
    assert [f["name"] for f in abi["functions"]] == ["encode_32", "encode_64"]
    f64 = abi["functions"][1]
    assert f64["bucket"] == 64 and f64["row_unit"] == TINY.merge_unit  # dense form: whole merge windows
    assert f64["inputs"] == [
        {"name": "patches", "shape": ["R", TINY.patch_dim], "dtype": "float32"},
        {"name": "pos_index", "shape": [4, "R"], "dtype": "int32"},
        {"name": "pos_weight", "shape": [4, "R"], "dtype": "float32"},
        {"name": "rope_pos", "shape": [2, "R"], "dtype": "int32"},
        {"name": "segment_ids", "shape": ["R"], "dtype": "int32"},
    ]
    assert [o["name"] for o in f64["outputs"]] == ["image_embeds", "deepstack_features.0", "deepstack_features.1"]
    assert all(o["shape"] == ["R/4", TINY.out_hidden_size] for o in f64["outputs"])
    assert abi["parameters"] == {"scope": "model", "file": "tiny-model.irpa",
                                 "content_key": abi["parameters"]["content_key"]}
    from emitter.video_policy import DEFAULT_VIDEO_POLICY
    assert abi["video_policy"] == DEFAULT_VIDEO_POLICY.to_dict()  # the checkpoint's: the released one
    cached = exported / "cache" / f"{abi['identity']}.vmfb"
    assert cached.read_bytes() == (out / "tiny-model.vmfb").read_bytes()
    open_archive(out / "tiny-model.irpa", TINY)  # exactly the graph's weights


def test_readme_command_runs_as_written(exported):
    """The README's first command line, run by the shell in the export folder."""
    readme = (exported / "out" / "README.txt").read_text()
    start = readme.index("  iree-run-module")
    command = readme[start:readme.index("\n\n", start)].replace("\\\n", " ")
    argv = shlex.split(command)
    argv[0] = str(IREE_RUN_MODULE)
    out = subprocess.run(argv, cwd=exported / "out", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "EXEC @encode_32" in out.stdout and "result[2]: hal.buffer_view\n8x48xf32=" in out.stdout


def test_iree_run_module_reproduces_qwen3vl_run(exported, tmp_path):
    """Inputs dumped by `qwen3vl run`, fed to IREE's own tool with the exported module and
    archive: the same outputs (the run packs these images into two calls of two buckets)."""
    rng = np.random.default_rng(5)
    images = []
    for i, (h, w) in enumerate(((64, 96), (100, 60), (130, 130))):  # 24, 24, 64 patches
        images.append(tmp_path / f"im{i}.png")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(images[-1])
    args = [a for b in BUCKETS for a in ("--bucket", b)]
    run = qwen3vl("run", "--model", str(exported / "tiny-model"), *map(str, images), *args, "--cache-dir",
                  str(exported / "cache"), "--dump-inputs", str(tmp_path / "dump"), "-o", str(tmp_path / "f.st"))
    assert run.returncode == 0, run.stderr
    expected = load_file(tmp_path / "f.st")
    abi = json.loads((exported / "out" / "abi.json").read_text())
    functions = {f["name"]: f for f in abi["functions"]}
    calls = sorted((tmp_path / "dump").iterdir())
    assert [c.name for c in calls] == ["00", "01"]
    parts: dict[str, list] = {}
    for folder in calls:
        call = json.loads((folder / "call.json").read_text())
        spec = functions[call["function"]]
        assert call["inputs"] == [f"{t['name']}.npy" for t in spec["inputs"]]
        assert call["rows"] % spec["row_unit"] == 0 and call["patches"] <= call["rows"] <= call["bucket"]
        for t in spec["inputs"]:
            array = np.load(folder / f"{t['name']}.npy")
            shape = [call["rows"] if d == "R" else d for d in t["shape"]]
            assert list(array.shape) == shape and array.dtype == np.dtype(t["dtype"])
        outputs = [tmp_path / f"{folder.name}.{t['name']}.npy" for t in spec["outputs"]]
        argv = [str(IREE_RUN_MODULE), "--device=local-task", f"--module={exported / 'out' / 'tiny-model.vmfb'}",
                f"--parameters=model={exported / 'out' / 'tiny-model.irpa'}", f"--function={call['function']}",
                *(f"--input=@{folder / name}" for name in call["inputs"]), *(f"--output=@{p}" for p in outputs)]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        for t, path in zip(spec["outputs"], outputs):
            parts.setdefault(t["name"], []).append(np.load(path)[:call["merged"]])
    embeds = np.concatenate(parts["image_embeds"])
    deepstack = np.stack([np.concatenate(parts[f"deepstack_features.{k}"]) for k in range(2)])
    assert embeds.shape == expected["image_embeds"].shape == (28, TINY.out_hidden_size)
    assert rel_l2(embeds, expected["image_embeds"]) <= 1e-6
    assert rel_l2(deepstack, expected["deepstack_features"]) <= 1e-6


def test_archive_is_content_addressed(exported, tmp_path):
    """The same weights in another folder reuse the cached archive; other weights do not."""
    shutil.copytree(exported / "tiny-model", tmp_path / "copy")
    seen: list[str] = []
    session = VisionSession(tmp_path / "copy", buckets=(32, 64), cache_dir=exported / "cache", progress=seen.append)
    assert not [m for m in seen if "writing" in m or "compiling" in m], seen
    assert session.archive_path.parent == exported / "cache"
    write_checkpoint(tmp_path / "other", TINY, seed=4, processor_policy_dict=SMALL_POLICY)
    other = VisionSession(tmp_path / "other", buckets=(32, 64), cache_dir=exported / "cache", progress=seen.append)
    assert other.archive_path != session.archive_path and any("writing" in m for m in seen)


def test_corrupt_archive_is_rebuilt_never_loaded(exported, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(exported / "cache", cache)
    first = VisionSession(exported / "tiny-model", buckets=(32, 64), cache_dir=cache)
    path, good = first.archive_path, first.archive_path.read_bytes()
    del first
    data = bytearray(good)
    data[len(data) // 2] ^= 0x01  # one bit of one weight
    path.write_bytes(bytes(data))
    seen: list[str] = []
    again = VisionSession(exported / "tiny-model", buckets=(32, 64), cache_dir=cache, progress=seen.append)
    rejected = [m for m in seen if "rejected" in m]
    assert len(rejected) == 1 and str(path) in rejected[0] and "sha256" in rejected[0]
    assert again.archive_path == path and path.read_bytes() == good


def _archive_with(tmp_path, edit) -> Path:
    """A real .irpa holding the tiny graph's weights, with `edit(name, array, spec) -> (name,
    array, metadata) or None` applied to each."""
    import iree.runtime as rt
    index, arrays = rt.ParameterIndex(), []
    for spec in graph_weights(TINY):
        entry = edit(spec.name, np.zeros(spec.shape, np.float32), spec)
        if entry is None:
            continue
        name, array, metadata = entry
        arrays.append(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        index.add_buffer(name, arrays[-1], metadata=metadata)
    path = tmp_path / "bad.irpa"
    index.create_archive_file(str(path))
    return path


QKV = "model.visual.blocks.1.attn.qkv.weight"


@pytest.mark.parametrize("case,needle", [
    ("missing", f"{QKV}: missing from"),
    ("shape", f"{QKV}: is float32 [64, 192]"),
    ("dtype", f"{QKV}: is bfloat16 [192, 64]"),
    ("extra", "model.visual.extra: in"),
])
def test_archive_that_does_not_match_the_config(tmp_path, case, needle):
    def edit(name, array, spec):
        if name != QKV:
            return name, array, tensor_metadata(spec.shape, "f32")
        if case == "missing":
            return None
        if case == "shape":
            return name, array, tensor_metadata((64, 192), "f32")
        if case == "dtype":
            return name, array, tensor_metadata(spec.shape, "bf16")
        return name, array, tensor_metadata(spec.shape, "f32")
    path = _archive_with(tmp_path, edit)
    if case == "extra":
        import iree.runtime as rt
        index = rt.ParameterIndex()
        index.load(str(path))
        extra = np.zeros(4, np.uint8)
        index.add_buffer("model.visual.extra", extra, metadata=tensor_metadata((1,), "f32"))
        index.create_archive_file(str(tmp_path / "extra.irpa"))
        path = tmp_path / "extra.irpa"
    with pytest.raises(ArchiveError) as e:
        open_archive(path, TINY)
    message = str(e.value)
    assert message.startswith(needle) and "\n" not in message and "expected" in message, message


def test_write_archive_round_trip_bf16(tmp_path):
    import ml_dtypes
    specs = graph_weights(TINY, "bf16")
    rng = np.random.default_rng(0)
    arrays = [(s.name, rng.standard_normal(s.shape).astype(np.float32 if s.dtype == "f32" else ml_dtypes.bfloat16))
              for s in specs]
    write_archive(tmp_path / "w.irpa", arrays, TINY, "bf16")
    from runtime.artifact.archive import entry_arrays
    index = open_archive(tmp_path / "w.irpa", TINY, "bf16")
    for view, (_, array) in zip(entry_arrays(index, specs), arrays):
        assert view.dtype == array.dtype
        np.testing.assert_array_equal(view, array)
    with pytest.raises(ArchiveError, match="expected float32"):
        open_archive(tmp_path / "w.irpa", TINY, "f32")
    assert [p.name for p in tmp_path.iterdir()] == ["w.irpa"]


def test_archive_written_tensor_by_tensor_is_iree_builders_byte_for_byte(tmp_path):
    """`write_archive` streams each tensor from a generator (`runtime/artifact/irpa.py`): the
    file is the one IREE's own builder writes for the same entries, and an array whose size
    is not its entry's is refused with nothing left behind."""
    import iree.runtime as rt
    import ml_dtypes
    specs = graph_weights(TINY, "bf16")
    rng = np.random.default_rng(1)
    arrays = [(s.name, rng.standard_normal(s.shape).astype(np.float32 if s.dtype == "f32" else ml_dtypes.bfloat16))
              for s in specs]
    index = rt.ParameterIndex()
    for spec, (name, array) in zip(specs, arrays):
        index.add_buffer(name, array.reshape(-1).view(np.uint8), metadata=tensor_metadata(spec.shape, spec.dtype))
    index.create_archive_file(str(tmp_path / "iree.irpa"))
    write_archive(tmp_path / "ours.irpa", (pair for pair in arrays), TINY, "bf16")
    assert (tmp_path / "ours.irpa").read_bytes() == (tmp_path / "iree.irpa").read_bytes()
    short = [(name, array[..., :1]) if i == 3 else (name, array) for i, (name, array) in enumerate(arrays)]
    with pytest.raises(ValueError, match=f"{arrays[3][0]}: .* bytes, expected"):
        write_archive(tmp_path / "bad.irpa", iter(short), TINY, "bf16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iree.irpa", "ours.irpa"]


@pytest.mark.parametrize("args,needle", [
    (("--model", "/nonexistent/m"), "--model /nonexistent/m"),
    (("--model", "{model}", "--bucket", "6"), "--bucket 6"),
    (("--model", "{model}", "-o", "{file}"), "is a file"),
    (("--model", "{model}", "-o", "/nonexistent/dir/out"), "does not exist"),
])
def test_export_bad_input(exported, tmp_path, args, needle):
    (tmp_path / "afile").write_text("x")
    subs = {"{model}": str(exported / "tiny-model"), "{file}": str(tmp_path / "afile")}
    args = [subs.get(a, a) for a in args]
    if "-o" not in args:
        args += ["-o", str(tmp_path / "out")]
    out = qwen3vl("export", *args, "--cache-dir", str(tmp_path / "cache"))
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_weights_are_packed_once_for_every_bucket():
    """Compiled for two buckets, the module holds one buffer of data-tiled (packed) weights,
    shared by every entry, the same size as for one bucket: IREE packs each weight once, at load."""
    import re
    import iree.compiler as ireec
    from emitter.targets import target_flags
    from emitter.vision import emit_artifact_module

    def packed(buckets):
        text = ireec.compile_str(emit_artifact_module(TINY, buckets),
                                 extra_args=[*target_flags("llvm-cpu"), "--compile-to=vm"])
        text = text.decode() if isinstance(text, bytes) else text
        return sorted(set(re.findall(r"vm\.global\.ref private mutable @(__hoisted_\w+__encoded)", text)))

    one, two = packed([16]), packed([16, 32])
    assert len(one) == 1 and two == one


def test_diagnostics_artifact_entries():
    """With diagnostics each bucket's entry returns the outputs, then the stages."""
    from emitter.vision import emit_artifact_module, result_names
    text = emit_artifact_module(TINY, [16, 32], diagnostics=True)
    assert "func.func @encode_16_diagnostics(" in text and "func.func @encode_32_diagnostics(" in text
    assert "func.func @encode_16(" not in text
    assert text.count('{iree.abi.name = "stage.merger.act"}') == 2
    assert result_names(TINY, True)[:3] == result_names(TINY)


def test_failed_export_leaves_nothing_behind(exported, tmp_path):
    """abi.json cannot be written (a folder stands in its place): one line, and neither the
    vmfb nor the archive is left in OUT without it."""
    out = tmp_path / "out"
    (out / "abi.json").mkdir(parents=True)
    args = [a for b in BUCKETS for a in ("--bucket", b)]
    result = qwen3vl("export", "--model", str(exported / "tiny-model"), "-o", str(out), *args,
                     "--cache-dir", str(exported / "cache"))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "abi.json" in lines[-1], result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["abi.json"]  # only what was there before


def test_rerun_replaces_the_export_whole_and_leaves_no_temp(exported, tmp_path):
    """A rerun into an earlier export (hard links onto the same cache entries) leaves no
    `.NAME.tmp.PID.*` behind, and one with other buckets replaces all four files."""
    out = tmp_path / "out"
    model, cache = str(exported / "tiny-model"), str(exported / "cache")
    for buckets in (BUCKETS, BUCKETS, BUCKETS[:1]):
        args = [a for b in buckets for a in ("--bucket", b)]
        result = qwen3vl("export", "--model", model, "-o", str(out), *args, "--cache-dir", cache)
        assert result.returncode == 0, result.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
        assert sorted(p.name for p in out.iterdir()) == ["README.txt", "abi.json", "tiny-model.irpa",
                                                         "tiny-model.vmfb"]
    assert [f["bucket"] for f in json.loads((out / "abi.json").read_text())["functions"]] == [32]


@pytest.mark.parametrize("case", ["user file", "checkpoint folder", "inside a file"])
def test_export_refuses_a_folder_it_would_overwrite_or_misname(exported, tmp_path, case):
    model = tmp_path / "m"
    shutil.copytree(exported / "tiny-model", model)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "abi.json").write_text("my own notes")
    out, needle = {"user file": (tmp_path / "mine", "holds other files (abi.json)"),
                   "checkpoint folder": (model, "is the checkpoint folder"),
                   "inside a file": (tmp_path / "afile" / "sub", "is a file, not a folder")}[case]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    result = qwen3vl("export", "--model", str(model), "-o", str(out), "--cache-dir", str(tmp_path / "cache"))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: -o {out}: ") and needle in lines[0], result.stderr
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


KILLED_FILLING = r"""
import os, sys
from pathlib import Path
from emitter.atomic import folder_atomic
with folder_atomic(Path(sys.argv[1]), replace=True) as tmp:
    (tmp / "a.vmfb").write_text("new")
    os.kill(os.getpid(), 9)  # killed between two files of the folder
"""


def test_a_folder_writer_killed_midway_leaves_the_old_folder_and_its_temp_goes_next_time(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.vmfb").write_text("old")
    (out / "abi.json").write_text("old")
    killed = subprocess.run([sys.executable, "-c", KILLED_FILLING, str(out)], capture_output=True)
    assert killed.returncode == -9
    assert {p.name: p.read_text() for p in out.iterdir()} == {"a.vmfb": "old", "abi.json": "old"}
    assert len(list(tmp_path.glob(".out.tmp.*"))) == 1  # the killed writer's
    from emitter.atomic import folder_atomic
    with folder_atomic(out, replace=True) as tmp:
        (tmp / "a.vmfb").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert {p.name: p.read_text() for p in out.iterdir()} == {"a.vmfb": "new"}
