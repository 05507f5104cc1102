"""Bad input and hostile conditions, as a careful user meets them: each one a
one-line error, a non-zero exit and nothing half-written; and no compile outliving
the command that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file, save_file

from emitter.atomic import WriteError, temp_prefix, write_atomic
from emitter.config import PRESETS
from helpers import exec_after
from runtime.checkpoints.synthetic import DEFAULT_PROCESSOR, write_checkpoint

BIN = Path(sys.executable).parent
QWEN3VL, EMIT = str(BIN / "qwen3vl"), str(BIN / "emit-qwen3vl")
TINY = PRESETS["tiny"]
SMALL_POLICY = dict(DEFAULT_PROCESSOR, size={"shortest_edge": 4096, "longest_edge": 32768})


def one_line_error(result, *named: str) -> str:
    """The command failed, and stderr ends with its one `error:` line (after any progress
    lines), naming every `named`."""
    assert result.returncode != 0, result.stdout
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == lines[-1:] and "Traceback" not in result.stderr, result.stderr
    for word in named:
        assert word in lines[-1], result.stderr
    return lines[-1]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny checkpoint and one 64x64 image beside it."""
    folder = tmp_path_factory.mktemp("tiny")
    write_checkpoint(folder / "model", TINY, seed=1, processor_policy_dict=SMALL_POLICY)
    image = folder / "a.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(image)
    return folder / "model", image


def run(model, image, *args, cache_dir, bucket="64", setup=None, env=None):
    """`qwen3vl run`, after the Python statements `setup` if given."""
    command = [QWEN3VL, "run", "--model", str(model), str(image), "--cache-dir", cache_dir, "--bucket", bucket, *args]
    return subprocess.run(exec_after(setup, command) if setup else command, capture_output=True, text=True, env=env)


# --------------------------------------------------------------------------- run

def test_huge_weights_give_an_error_not_nan_features(tmp_path, tiny, cache_dir):
    model, image = tiny
    huge = tmp_path / "huge"
    write_checkpoint(huge, TINY, seed=1, processor_policy_dict=SMALL_POLICY)
    tensors = load_file(huge / "model.safetensors")
    tensors["model.visual.blocks.0.attn.qkv.weight"] *= np.float32(1e30)  # finite, but overflows in the tower
    save_file(tensors, huge / "model.safetensors")
    out = tmp_path / "f.safetensors"
    one_line_error(run(huge, image, "-o", str(out), cache_dir=cache_dir), "image_embeds", "NaN or inf")
    assert not out.exists() and not list(tmp_path.glob(f"{temp_prefix(out)}*"))


@pytest.mark.parametrize("target", ["image", "weights", "new weight file", "config", "config via symlink"])
def test_output_that_is_an_input_is_refused(tmp_path, tiny, cache_dir, target):
    model, image = tiny
    link = tmp_path / "link"
    link.symlink_to(model)
    output = {"image": image, "weights": model / "model.safetensors", "new weight file": model / "f.safetensors",
              "config": model / ".." / model.name / "config.json", "config via symlink": link / "config.json"}[target]
    before = {p.name: p.read_bytes() for p in [image, *model.iterdir()]}
    one_line_error(run(model, image, "-o", str(output), cache_dir=cache_dir), f"-o {output}")
    assert {p.name: p.read_bytes() for p in [image, *model.iterdir()]} == before


@pytest.mark.parametrize("case", ["folder", "missing folder", "parent is a file", "fifo"])
def test_output_location_is_checked_before_any_work(tmp_path, tiny, cache_dir, case):
    model, image = tiny
    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    output = {"folder": tmp_path, "missing folder": tmp_path / "no" / "f.safetensors",
              "parent is a file": tmp_path / "file" / "f.safetensors", "fifo": tmp_path / "fifo"}[case]
    empty_cache = tmp_path / "cache"
    line = one_line_error(run(model, image, "-o", str(output), cache_dir=str(empty_cache)), f"-o {output}")
    assert ".tmp" not in line
    assert not empty_cache.exists()  # refused before anything was compiled


@pytest.mark.parametrize("threads", ["0", "-1"])
def test_threads_below_one_are_refused(tiny, cache_dir, threads):
    model, image = tiny
    one_line_error(run(model, image, "--threads", threads, cache_dir=cache_dir), f"--threads {threads}", "1 or more")


def test_bucket_larger_than_memory_is_refused_before_compiling(tmp_path, tiny):
    model, image = tiny
    empty_cache = tmp_path / "cache"
    result = run(model, image, bucket="40000000", cache_dir=str(empty_cache))  # 229 GiB of patches alone
    one_line_error(result, "--bucket 40000000", "does not fit in memory")
    assert not list(empty_cache.rglob("*.vmfb"))  # nothing compiled


@pytest.mark.slow  # compiles and runs bucket 8192
def test_bucket_that_exhausts_the_allocator_is_a_one_line_error(tiny, cache_dir, tmp_path):
    """Past the estimate (its largest buffer, 48 MiB of patches, fits in 640 MiB of address
    space; the run needs more), an allocation fails at run time: that too names the bucket.
    A call's rows are its image's (7744 patches, 8192 rows), not the bucket's.
    (Measured: at 640 MiB the process starts and bucket 4096 runs; 8192 runs at 768 MiB.)"""
    model, image = tmp_path / "model", tmp_path / "big.png"
    write_checkpoint(model, TINY, seed=1)  # the released processor: a 1408x1408 image as it is
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (1408, 1408, 3), dtype=np.uint8)).save(image)
    warm = run(model, image, "--threads", "1", bucket="8192", cache_dir=cache_dir)  # compile, unlimited
    assert warm.returncode == 0, warm.stderr

    limit = "import resource; resource.setrlimit(resource.RLIMIT_AS, (640 << 20, 640 << 20))"
    result = run(model, image, "--threads", "1", bucket="8192", cache_dir=cache_dir, setup=limit,
                 env=dict(os.environ, MALLOC_ARENA_MAX="1"))
    one_line_error(result, "--bucket 8192", "does not fit in memory")


def test_target_without_its_driver_names_both(tiny, cache_dir):
    import iree.runtime as rt
    try:
        rt.Config("cuda")
        pytest.skip("this machine has a CUDA device")
    except (RuntimeError, ValueError):
        pass
    model, image = tiny
    one_line_error(run(model, image, "--target", "cuda-sm80", cache_dir=cache_dir), "--target cuda-sm80", "CUDA")


# --------------------------------------------------------------------------- emit-qwen3vl, build

def test_emit_with_stdout_closed_is_a_one_line_error():
    result = subprocess.run(f"'{EMIT}' --bucket 16 --preset tiny >&-", shell=True, capture_output=True, text=True)
    assert result.returncode == 2
    one_line_error(result, "stdout is closed")


def test_emit_into_a_reader_that_went_away_is_a_one_line_error():
    read, write = os.pipe()
    os.close(read)
    result = subprocess.run([EMIT, "--bucket", "16", "--preset", "tiny"], stdout=write, stderr=subprocess.PIPE,
                            text=True)
    os.close(write)
    one_line_error(result, "stdout closed")


@pytest.mark.parametrize("command", [[EMIT, "--bucket", "16"], [QWEN3VL, "build", "--bucket", "16", "--explain"]])
def test_inspect_block_without_diagnostics_is_refused(tmp_path, command):
    result = subprocess.run([*command, "--preset", "tiny", "--inspect-block", "1", "--cache-dir", str(tmp_path)]
                            if "build" in command else [*command, "--preset", "tiny", "--inspect-block", "1"],
                            capture_output=True, text=True)
    one_line_error(result, "--inspect-block 1", "--diagnostics")


@pytest.mark.parametrize("case", ["json into a missing folder", "json is a folder", "threads 0"])
def test_bench_refuses_bad_options_before_any_work(tmp_path, case):
    args = {"json into a missing folder": (["--json", str(tmp_path / "no" / "b.json")], "--json"),
            "json is a folder": (["--json", str(tmp_path)], "is a folder"),
            "threads 0": (["--threads", "0"], "--threads 0")}[case]
    result = subprocess.run([QWEN3VL, "bench", "--preset", "tiny", "--bucket", "16", "--images", "32x32",
                             "--no-torch", *args[0]], capture_output=True, text=True)
    one_line_error(result, args[1])
    assert result.stdout == ""  # no figures: refused before the run


# --------------------------------------------------------------------------- killing a build

def children_named(pid: int, name: str) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(pid) and fields.get("Name", "").strip() == name:
            found.append(int(status.parent.name))
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has been killed, only not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killing_build_kills_its_compile(tmp_path, sig):
    build = subprocess.Popen([QWEN3VL, "build", "--preset", "qwen3-vl-2b", "--bucket", "64", "--cache-dir",
                              str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (compiles := children_named(build.pid, "iree-compile")):
            assert build.poll() is None and time.monotonic() < deadline, "no iree-compile started"
            time.sleep(0.05)
        build.send_signal(sig)
        build.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(running(pid) for pid in compiles) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(running(pid) for pid in compiles), "iree-compile outlived qwen3vl build"
        if sig == signal.SIGTERM:
            assert build.returncode == 128 + signal.SIGTERM
            assert build.stderr.read().strip().splitlines()[-1] == "error: terminated (SIGTERM)"
        assert not list(tmp_path.rglob("*.vmfb"))
    finally:
        build.kill()
        build.wait()


# --------------------------------------------------------------------------- atomic writes

def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_killed_writers_temp_is_removed_by_the_next_write(tmp_path):
    target = tmp_path / "f.safetensors"
    stale = tmp_path / f"{temp_prefix(target)}{dead_pid()}.abc123"  # what kill -9 before the rename leaves
    stale.write_bytes(b"complete but never renamed")
    live = tmp_path / f"{temp_prefix(target)}{os.getppid()}.def456"  # a writer still running: kept
    live.write_bytes(b"in progress")
    other = tmp_path / f"{temp_prefix(tmp_path / 'g.safetensors')}{dead_pid()}.x"  # another target's: kept
    other.write_bytes(b"")
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, live.name, other.name])


def test_run_removes_the_temp_of_a_writer_killed_before_its_rename(tmp_path, tiny, cache_dir):
    """A real writer (write_atomic in another process) killed with SIGKILL while its temp
    exists; the next `qwen3vl run -o` of the same target removes what it left."""
    model, image = tiny
    target = tmp_path / "f.safetensors"
    writer = subprocess.Popen([sys.executable, "-c", "import sys; from emitter.atomic import write_atomic; "
                               "write_atomic(sys.argv[1], bytes(256 << 20))", str(target)])
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(f"{temp_prefix(target)}{writer.pid}.*")):
        assert writer.poll() is None and time.monotonic() < deadline, "the writer never made its temp"
        time.sleep(0.001)
    writer.kill()
    writer.wait()
    assert list(tmp_path.glob(f"{temp_prefix(target)}*")) and not target.exists()
    result = run(model, image, "-o", str(target), cache_dir=cache_dir)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]
    assert set(load_file(target)) == {"image_embeds", "deepstack_features", "grid_thw"}


def test_write_error_names_the_target_not_the_temp(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    with pytest.raises(WriteError) as info:
        write_atomic(folder, b"x")
    assert str(info.value) == f"cannot write {folder}: is a folder"
    with pytest.raises(WriteError) as info:
        write_atomic(tmp_path / "missing" / "f", b"x")
    assert ".tmp" not in str(info.value) and str(tmp_path / "missing" / "f") in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
