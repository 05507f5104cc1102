"""The artifact cache and `qwen3vl build`: hits, rejected entries, concurrency, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from emitter.config import PRESETS
from emitter.identity import vision_artifact_fields, artifact_identity
from emitter.policy import DEFAULT_POLICY
from emitter.vision import emit_vision_module
from runtime.artifact.cache import ArtifactCache, CacheError, load_verified
from runtime.artifact.compiler import compile_mlir

TINY = PRESETS["tiny"]
QWEN3VL = [sys.executable, "-c", "from runtime.commands.main import main; main()"]


class CountingBuild:
    """The real compile of tiny/16, done once per module; counts how often the cache asks."""
    vmfb: bytes | None = None

    def __init__(self):
        self.calls = 0

    def __call__(self) -> bytes:
        self.calls += 1
        if CountingBuild.vmfb is None:
            CountingBuild.vmfb = compile_mlir(emit_vision_module(TINY, 16))
        return CountingBuild.vmfb


@pytest.fixture(scope="module")
def fields():
    return vision_artifact_fields(TINY, 16, DEFAULT_POLICY)


def messages():
    seen: list[str] = []
    return seen, seen.append


def test_build_then_hit(tmp_path, fields):
    cache, build = ArtifactCache(tmp_path / "c"), CountingBuild()
    path, built = cache.get_or_build(fields, build)
    assert built and build.calls == 1
    identity = artifact_identity(fields)
    assert path == tmp_path / "c" / f"{identity}.vmfb"
    manifest = json.loads(path.with_suffix(".json").read_text())
    assert manifest["identity"] == identity and manifest["fields"] == fields
    assert manifest["vmfb"]["size"] == path.stat().st_size and manifest["created"]
    assert load_verified(path) == CountingBuild.vmfb
    again, built = cache.get_or_build(fields, build)
    assert again == path and not built and build.calls == 1
    assert not list((tmp_path / "c").glob("*.tmp")) and not list((tmp_path / "c").glob(".*"))


def test_env_var_root(tmp_path, monkeypatch):
    monkeypatch.setenv("QWEN3VL_CACHE_DIR", str(tmp_path / "env"))
    assert ArtifactCache().root == tmp_path / "env"
    monkeypatch.delenv("QWEN3VL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ArtifactCache().root == tmp_path / "xdg" / "qwen3vl-iree"


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_bad_vmfb_is_reported_and_rebuilt(tmp_path, fields, damage):
    cache, build = ArtifactCache(tmp_path), CountingBuild()
    path, _ = cache.get_or_build(fields, build)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:100]))
    else:
        path.unlink()
    if damage != "delete":
        with pytest.raises(CacheError, match="does not check out"):
            load_verified(path)
    seen, progress = messages()
    again, built = cache.get_or_build(fields, build, progress=progress)
    assert built and build.calls == 2
    assert len(seen) == 1 and str(path) in seen[0] and "rebuilding" in seen[0]
    assert load_verified(again) == CountingBuild.vmfb


@pytest.mark.parametrize("damage", ["truncate", "garbage", "wrong_fields", "delete"])
def test_bad_manifest_is_reported_and_rebuilt(tmp_path, fields, damage):
    cache, build = ArtifactCache(tmp_path), CountingBuild()
    path, _ = cache.get_or_build(fields, build)
    manifest = path.with_suffix(".json")
    text = manifest.read_text()
    if damage == "truncate":
        manifest.write_text(text[: len(text) // 2])
    elif damage == "garbage":
        manifest.write_text("[1, 2]")
    elif damage == "wrong_fields":
        doc = json.loads(text)
        doc["fields"]["bucket"] = 32
        manifest.write_text(json.dumps(doc))
    else:
        manifest.unlink()
    seen, progress = messages()
    again, built = cache.get_or_build(fields, build, progress=progress)
    assert built and build.calls == 2 and again == path
    assert len(seen) == 1 and str(manifest) in seen[0]
    assert json.loads(manifest.read_text())["fields"] == fields


def test_failed_build_leaves_nothing(tmp_path, fields):
    def broken():
        raise RuntimeError("compiler blew up")
    with pytest.raises(RuntimeError):
        ArtifactCache(tmp_path).get_or_build(fields, broken)
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".lock"]


def test_unwritable_cache_dir(tmp_path, fields):
    (tmp_path / "afile").write_text("x")
    bad = tmp_path / "afile" / "cache"
    build = CountingBuild()
    with pytest.raises(CacheError, match=str(bad)):
        ArtifactCache(bad).get_or_build(fields, build)
    assert build.calls == 0


CONCURRENT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from emitter.config import PRESETS
    from emitter.identity import vision_artifact_fields
    from emitter.policy import DEFAULT_POLICY
    from emitter.vision import emit_vision_module
    from runtime.artifact.cache import ArtifactCache, load_verified
    from runtime.artifact.compiler import compile_mlir
    root, marker, ready, go = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    fields = vision_artifact_fields(PRESETS["tiny"], 16, DEFAULT_POLICY)
    def build():
        with open(marker, "a") as f:
            f.write("compiled\\n")
        return compile_mlir(emit_vision_module(PRESETS["tiny"], 16))
    ready.write_text("ready")  # imports and identity resolution done
    while not go.exists():
        time.sleep(0.01)
    path, built = ArtifactCache(root).get_or_build(fields, build)
    print(len(load_verified(path)), built)
""")


def test_concurrent_builds_compile_once(tmp_path):
    marker, go = tmp_path / "compiles.txt", tmp_path / "go"
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT, str(tmp_path / "c"), str(marker), str(r), str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in ready]
    deadline = time.time() + 60
    while not all(r.exists() for r in ready) and time.time() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.01)
    go.write_text("go")  # both ask for the same identity at once; the compile takes seconds
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert marker.read_text().count("compiled") == 1
    results = sorted(o[0].split()[1] for o in outs)
    assert results == ["False", "True"] and outs[0][0].split()[0] == outs[1][0].split()[0]


# --------------------------------------------------------------------------- qwen3vl CLI

def qwen3vl(*args, env=None):
    return subprocess.run([*QWEN3VL, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_cli_build_twice_second_is_hit(tmp_path):
    args = ("build", "--preset", "tiny", "--bucket", "16", "--cache-dir", str(tmp_path))
    first = qwen3vl(*args)
    assert first.returncode == 0, first.stderr
    assert " built " in first.stdout and "compiling" in first.stderr and "compiled in" in first.stderr
    second = qwen3vl(*args)
    assert second.returncode == 0, second.stderr
    assert " hit " in second.stdout and "compiling" not in second.stderr
    ident = first.stdout.split()[2]
    assert second.stdout.split()[2] == ident and len(list(tmp_path.glob(f"{ident}*.vmfb"))) == 1
    explain = qwen3vl(*args, "--explain")
    assert explain.returncode == 0 and "cached at" in explain.stdout and "identity " + ident in explain.stdout


def test_cli_presets():
    out = qwen3vl("presets")
    assert out.returncode == 0
    tiny = next(line for line in out.stdout.splitlines() if line.startswith("tiny "))
    assert tiny.split() == ["tiny", "4", "64", "48", "1,2"]


@pytest.mark.parametrize("args,needle", [
    (("--preset", "tiny", "--bucket", "0"), "--bucket 0"),
    (("--preset", "tiny", "--bucket", "6"), "--bucket 6"),
    (("--preset", "tiny", "--bucket", "-4"), "--bucket -4"),
    (("--preset", "tiny", "--bucket", "abc"), "--bucket 'abc'"),
    (("--preset", "nope"), "--preset 'nope'"),
    (("--model", "/nonexistent/model"), "/nonexistent/model"),
    (("--preset", "tiny", "--target", "tpu"), "--target 'tpu'"),
    ((), "--model DIR or --preset NAME"),
    (("--preset", "tiny", "--bucket", "16", "--cache-dir", "{file}/cache"), "{file}/cache"),
])
def test_cli_bad_input(tmp_path, args, needle):
    afile = tmp_path / "afile"
    afile.write_text("x")
    cache = tmp_path / "cache"
    args = [a.replace("{file}", str(afile)) for a in args]
    needle = needle.replace("{file}", str(afile))
    if "--cache-dir" not in args:
        args += ["--cache-dir", str(cache)]
    out = qwen3vl("build", *args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], out.stderr
    assert "expected" in lines[0] or "give one" in lines[0]
    assert out.stdout == ""
    assert not cache.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_cli_model_folder(tmp_path):
    """--model reads config.json and preprocessor_config.json (the policy is in the identity)."""
    import dataclasses
    from runtime.checkpoints.synthetic import write_checkpoint
    policy = dataclasses.replace(DEFAULT_POLICY, max_pixels=512 * 512)
    write_checkpoint(tmp_path / "m", TINY, processor_policy_dict=policy.to_preprocessor_config())
    out = qwen3vl("build", "--model", str(tmp_path / "m"), "--bucket", "16", "--cache-dir",
                  str(tmp_path / "c"), "--explain")
    assert out.returncode == 0, out.stderr
    fields = vision_artifact_fields(TINY, 16, policy, weights="parameters")
    assert out.stdout.splitlines()[1] == f"identity {artifact_identity(fields)}"
    assert not (tmp_path / "c").exists() or not list((tmp_path / "c").iterdir())
    (tmp_path / "m" / "preprocessor_config.json").unlink()
    out = qwen3vl("build", "--model", str(tmp_path / "m"), "--bucket", "16", "--cache-dir", str(tmp_path / "c"))
    assert out.returncode == 2 and out.stderr.startswith("error: ") and "preprocessor_config.json" in out.stderr


def test_full_disk_leaves_no_vmfb_without_manifest(tmp_path, fields):
    """A real full file system (a tmpfs just big enough for the vmfb, not its manifest):
    the build fails with one error naming the cache, and leaves no vmfb behind."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    vmfb = CountingBuild()()
    root = tmp_path / "small"
    root.mkdir()
    size = (len(vmfb) + 4095) // 4096 * 4096
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(root)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with pytest.raises(CacheError, match=f"cache folder {root}: cannot write entry"):
            ArtifactCache(root).get_or_build(fields, CountingBuild())
        assert sorted(p.suffix for p in root.iterdir()) == [".lock"]
    finally:
        subprocess.run(["umount", str(root)])


def test_cli_rejection_is_reported_once(tmp_path):
    args = ("build", "--preset", "tiny", "--bucket", "16", "--cache-dir", str(tmp_path))
    assert qwen3vl(*args).returncode == 0
    vmfb = next(tmp_path.glob("*.vmfb"))
    vmfb.write_bytes(vmfb.read_bytes()[:-1])
    out = qwen3vl(*args)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("rejected") == 1 and str(vmfb) in out.stderr


def test_cli_build_model_writes_the_weight_archive(tmp_path):
    from runtime.checkpoints.synthetic import write_checkpoint
    write_checkpoint(tmp_path / "m", TINY)
    args = ("build", "--model", str(tmp_path / "m"), "--bucket", "16", "--cache-dir", str(tmp_path / "c"))
    first = qwen3vl(*args)
    assert first.returncode == 0, first.stderr
    archive = first.stdout.splitlines()[-1].split()[-1]
    assert first.stdout.splitlines()[-1].startswith("weights ") and archive.endswith(".irpa")
    assert "weights: writing" in first.stderr
    second = qwen3vl(*args)
    assert second.returncode == 0 and second.stdout.splitlines()[-1].split()[-1] == archive
    assert "writing" not in second.stderr and "compiling" not in second.stderr


def test_checkpoint_digests_are_remembered_by_stat(tmp_path, monkeypatch):
    """`digests.Digests`: the sha256 of a file range, kept under the cache root beside the
    file's stat and reused by a later process while the stat holds; bytes rewritten (same
    size, a later mtime) are read again, and a file written in the last 2 s is not
    remembered at all (its mtime may still move within the clock's tick)."""
    import hashlib

    from runtime.artifact import digests as d

    data = os.urandom(1 << 20)
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    old = time.time() - 60
    os.utime(path, (old, old))
    reads = []
    real = d.sha256_range
    monkeypatch.setattr(d, "sha256_range", lambda *args: reads.append(args) or real(*args))

    first = d.Digests(tmp_path / "cache")
    assert first(path, 100, 5000) == hashlib.sha256(data[100:5000]).hexdigest()
    assert first(path) == hashlib.sha256(data).hexdigest()
    first.save()
    again = d.Digests(tmp_path / "cache")  # as a later process
    assert again(path, 100, 5000) == hashlib.sha256(data[100:5000]).hexdigest()
    assert again(path) == hashlib.sha256(data).hexdigest()
    assert len(reads) == 2

    changed = bytes([data[0] ^ 1]) + data[1:]
    path.write_bytes(changed)
    os.utime(path, (old + 1, old + 1))
    assert d.Digests(tmp_path / "cache")(path) == hashlib.sha256(changed).hexdigest()
    assert len(reads) == 3

    path.write_bytes(data)  # just now: read, not remembered
    recent = d.Digests(tmp_path / "cache")
    assert recent(path) == hashlib.sha256(data).hexdigest()
    recent.save()
    assert d.Digests(tmp_path / "cache")(path) == hashlib.sha256(data).hexdigest()
    assert len(reads) == 5
