"""`qwen3vl embed` end to end, on the real IREE runtime and a real local Ray cluster of
2 workers (tiny preset): rows equal to `qwen3vl run`'s, locally and on Ray; resume after
a lost shard and a lost index write; a failed image recorded and the job going on; an
actor killed mid-run; the driver killed mid-run; vLLM's layout; Ray not installed."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import rel_l2
from helpers import write_images
from emitter.config import PRESETS
from runtime.checkpoints.synthetic import DEFAULT_PROCESSOR, write_checkpoint

QWEN3VL = str(Path(sys.executable).parent / "qwen3vl")
TINY = PRESETS["tiny"]
POLICY = dict(DEFAULT_PROCESSOR, size={"shortest_edge": 4096, "longest_edge": 65536})  # up to 256 patches
BUCKETS = ["--bucket", "64", "--bucket", "128"]
SIZES = [(96, 64), (200, 90), (64, 64), (130, 170), (40, 250), (150, 110)]  # (w, h), all <= 128 patches
K = len(TINY.deepstack_visual_indexes)


def qwen3vl(*args, **kwargs):
    return subprocess.run([QWEN3VL, *args], capture_output=True, text=True, **kwargs)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny checkpoint, a cache, images (a folder with a subfolder), and `qwen3vl run`'s
    rows for each image: the reference every engine must give."""
    root = tmp_path_factory.mktemp("embed")
    write_checkpoint(root / "model", TINY, seed=3, processor_policy_dict=POLICY)
    (root / "images" / "sub").mkdir(parents=True)
    images = write_images(root / "images", SIZES[:4], seed=1) + write_images(root / "images" / "sub", SIZES[4:],
                                                                             seed=2, stem="s")
    cache = str(root / "cache")
    out = root / "run.safetensors"
    result = qwen3vl("run", "--model", str(root / "model"), *images, "-o", str(out), *BUCKETS, "--cache-dir", cache)
    assert result.returncode == 0, result.stderr
    return root, sorted(images), cache, split_run(load_file(out), images)


def split_run(features, images) -> dict[str, np.ndarray]:
    """`qwen3vl run`'s file -> per image [1 + K, rows, D]."""
    rows, start, out = [int(np.prod(g)) // 4 for g in features["grid_thw"]], 0, {}
    stacked = np.concatenate([features["image_embeds"][None], features["deepstack_features"]])
    for image, n in zip(images, rows):
        out[image] = stacked[:, start:start + n]
        start += n
    return out


def embed(setup, out, *args, inputs=None):
    root, images, cache, _ = setup
    return qwen3vl("embed", "--model", str(root / "model"), *(inputs or [str(root / "images")]), "-o", str(out),
                   *BUCKETS, "--cache-dir", cache, "--no-progress", *args)


def read_index(out) -> dict:
    return json.loads((Path(out) / "index.json").read_text())


def embedded_rows(out) -> dict[str, np.ndarray]:
    """Every encoded image's rows, [1 + K, rows, D], read back through the index; each
    image once, each shard row used once."""
    index, shards, used = read_index(out), {}, {}
    rows = {}
    for entry in index["images"]:
        if "error" in entry:
            continue
        assert entry["image"] not in rows, f"{entry['image']} twice in the index"
        shard = shards.setdefault(entry["shard"], load_file(Path(out) / entry["shard"]))
        span = slice(entry["start"], entry["start"] + entry["rows"])
        main = shard["image_embeds"][span]
        if index["format"] == "vllm":
            rows[entry["image"]] = np.stack(np.split(main, 1 + K, axis=1))
        else:
            rows[entry["image"]] = np.concatenate([main[None], shard["deepstack_features"][:, span]])
        used.setdefault(entry["shard"], []).append(span)
        grid = shard["grid_thw"][len(used[entry["shard"]]) - 1]
        assert list(grid) == entry["grid_thw"] and int(np.prod(grid)) // 4 == entry["rows"]
    for name, spans in used.items():  # the shard's rows are exactly its entries' rows, in order
        assert [s.start for s in spans] == [0] + [s.stop for s in spans[:-1]]
        assert spans[-1].stop == len(shards[name]["image_embeds"]) == int(np.prod(shards[name]["grid_thw"], 1).sum()) // 4
    return rows


def assert_rows_equal_run(rows, reference, images) -> None:
    assert sorted(rows) == sorted(images)
    for image in images:
        assert rows[image].shape == reference[image].shape
        assert rel_l2(rows[image], reference[image]) <= 1e-6, image


# --------------------------------------------------------------------------- local

def test_local_equals_run_and_index(setup, tmp_path):
    root, images, _, reference = setup
    result = embed(setup, tmp_path / "out", "--batch", "4")
    assert result.returncode == 0, result.stderr
    for word in ("embedded 6 images", "rows", "images/s", "skipped 0", "failed 0"):
        assert word in result.stdout
    index = read_index(tmp_path / "out")
    assert index["engine"] == "local" and index["format"] == "native" and len(index["model"]) == 64
    assert [e["image"] for e in index["images"]] == images  # folder order: sorted, recursive
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".embed.lock", "index.json",
                                                                     "shard-00000.safetensors",
                                                                     "shard-00001.safetensors"]
    assert_rows_equal_run(embedded_rows(tmp_path / "out"), reference, images)


def test_vllm_format(setup, tmp_path):
    """One tensor per shard, [tokens, out_hidden x (1 + K)]: main, then each DeepStack feature."""
    root, images, _, reference = setup
    result = embed(setup, tmp_path / "out", "--format", "vllm")
    assert result.returncode == 0, result.stderr
    shard = load_file(tmp_path / "out" / "shard-00000.safetensors")
    assert sorted(shard) == ["grid_thw", "image_embeds"]
    assert shard["image_embeds"].shape[1] == TINY.out_hidden_size * (1 + K)
    assert_rows_equal_run(embedded_rows(tmp_path / "out"), reference, images)
    other = embed(setup, tmp_path / "out")  # the same folder in another format: refused
    assert other.returncode == 2 and other.stderr.count("\n") == 1 and "format" in other.stderr


def test_driver_killed_mid_run_then_resumed(setup, tmp_path):
    """SIGKILL the driver once a shard is there; the rerun skips what the index (or a
    shard whose index write was lost) holds, and ends with each image once."""
    root, _, _, _ = setup
    many = write_images(tmp_path, [(64 + 8 * (i % 5), 64) for i in range(60)], seed=5)
    listing = tmp_path / "list.txt"
    listing.write_text("# sixty images\n" + "\n".join(Path(p).name for p in many) + "\n")
    out = tmp_path / "out"
    args = ["embed", "--model", str(root / "model"), str(listing), "-o", str(out), *BUCKETS,
            "--cache-dir", setup[2], "--no-progress", "--batch", "1"]
    proc = subprocess.Popen([QWEN3VL, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while proc.poll() is None and len(list(out.glob("shard-*.safetensors"))) < 3:
        time.sleep(0.01)
    assert proc.poll() is None, "finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = len(list(out.glob("shard-*.safetensors")))
    assert 3 <= before < 60
    result = qwen3vl(*args)
    assert result.returncode == 0, result.stderr
    skipped = int(result.stderr.split("skipping ")[1].split()[0])
    assert skipped >= before  # every shard on disk counted, listed or taken back
    rows = embedded_rows(out)
    assert sorted(rows) == sorted(many)
    again = qwen3vl(*args)
    assert again.returncode == 0 and "skipping 60 images" in again.stderr and "embedded 0 images" in again.stdout


def test_rerun_redoes_the_images_of_a_truncated_shard(setup, tmp_path):
    """A shard cut to 1 KB after the run: the rerun does not trust the index's rows in it
    but embeds those images again, and every image reads back equal to `qwen3vl run`."""
    root, images, _, reference = setup
    out = tmp_path / "out"
    assert embed(setup, out, "--batch", "4").returncode == 0
    shard = out / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:1024])
    result = embed(setup, out, "--batch", "4")
    assert result.returncode == 0, result.stderr
    assert "4 images are listed in shards missing or damaged" in result.stderr and "embedded 4 images" in result.stdout
    assert_rows_equal_run(embedded_rows(out), reference, images)


def test_bad_arguments_are_one_line(setup, tmp_path):
    root, images, _, _ = setup
    (tmp_path / "file").write_text("x")
    cases = {
        ("--batch", "0"): "--batch 0",
        ("--ray-local", "0"): "--ray-local 0",
        ("--ray-local", "2", "--threads", "3"): "--threads 3",  # an actor no worker could hold
        ("--ray-local", "2", "--ray", "127.0.0.1:1"): "give one",
        ("--ray", "127.0.0.1:1"): "no Ray cluster answers there",  # at once, not after Ray's minutes of retries
    }
    for args, words in cases.items():
        result = embed(setup, tmp_path / "out", *args)
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and words in result.stderr, result.stderr
    result = embed(setup, tmp_path / "out", inputs=[str(tmp_path / "missing")])
    assert result.returncode == 2 and "INPUT" in result.stderr and result.stderr.count("\n") == 1
    result = embed(setup, tmp_path / "file")
    assert result.returncode == 2 and "is a file" in result.stderr
    result = embed(setup, root / "model")
    assert result.returncode == 2 and "checkpoint folder" in result.stderr
    assert not (tmp_path / "out").exists()
    (tmp_path / "busy").mkdir()
    with open(tmp_path / "busy" / ".embed.lock", "w") as lock:  # another embed writing there
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = embed(setup, tmp_path / "busy")
    assert result.returncode == 2 and "another qwen3vl embed is writing there" in result.stderr
    assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == [".embed.lock"]


def test_without_ray_installed(setup, tmp_path):
    """Ray made unimportable: local embed works, --ray-local says how to install it."""
    root, images, cache, reference = setup
    code = "import sys; sys.modules['ray'] = None; from runtime.commands.main import main; main()"
    base = [sys.executable, "-c", code, "embed", "--model", str(root / "model"), images[0], *BUCKETS,
            "--cache-dir", cache, "--no-progress", "-o"]
    local = subprocess.run(base + [str(tmp_path / "a")], capture_output=True, text=True)
    assert local.returncode == 0, local.stderr
    ray = subprocess.run(base + [str(tmp_path / "b"), "--ray-local", "2"], capture_output=True, text=True)
    assert ray.returncode == 2 and ray.stderr.count("\n") == 1
    assert "--ray-local 2" in ray.stderr and "pip install" in ray.stderr
    assert not (tmp_path / "b").exists()


# --------------------------------------------------------------------------- Ray

def test_ray_local_equals_run(setup, tmp_path):
    """--ray-local 2: a cluster of its own; the same rows and shards as the local engine."""
    pytest.importorskip("ray.data")
    root, images, _, reference = setup
    result = embed(setup, tmp_path / "out", "--ray-local", "2", "--batch", "4")
    assert result.returncode == 0, result.stderr
    index = read_index(tmp_path / "out")
    assert index["engine"] == "ray" and [e["image"] for e in index["images"]] == images
    assert_rows_equal_run(embedded_rows(tmp_path / "out"), reference, images)


@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster of 2 workers for the tests below (joined with --ray ADDRESS);
    its object store capped; shut down after them."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, object_store_memory=500 * 2**20, include_dashboard=False,
             logging_level="ERROR")
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def test_ray_failed_images_recorded_and_resume(setup, tmp_path, cluster):
    """Unreadable, missing and too-large images are failed entries with their reason; the
    others are embedded; exit 1. A shard lost and an index write lost: the rerun redoes
    exactly the lost images."""
    root, images, _, reference = setup
    (tmp_path / "bad.png").write_bytes(b"not a png")
    large = write_images(tmp_path, [(300, 200)], stem="large")[0]  # 234 patches > bucket 128
    listing = tmp_path / "list.txt"
    listing.write_text("\n".join([*images[:3], str(tmp_path / "bad.png"), "nowhere.png", large, *images[3:]]) + "\n")
    out = tmp_path / "out"
    result = embed(setup, out, "--ray", cluster, "--batch", "2", inputs=[str(listing)])
    assert result.returncode == 1, result.stderr
    assert "failed 3" in result.stdout and "embedded 6 images" in result.stdout
    failed = {Path(e["image"]).name: e["error"] for e in read_index(out)["images"] if "error" in e}
    assert sorted(failed) == ["bad.png", "large0.png", "nowhere.png"]
    assert "cannot decode image" in failed["bad.png"] and "no such image file" in failed["nowhere.png"]
    assert "fit no bucket" in failed["large0.png"] and all("\n" not in e for e in failed.values())
    assert_rows_equal_run(embedded_rows(out), reference, images)

    # lose shard 1 (a crash before it was written: file and entries) and the index entries
    # of shard 2 (a crash between its write and the index's)
    index = read_index(out)
    assert sum(e.get("shard") == "shard-00001.safetensors" for e in index["images"]) == 2
    (out / "shard-00001.safetensors").unlink()
    index["images"] = [e for e in index["images"] if e.get("shard") not in ("shard-00001.safetensors",
                                                                            "shard-00002.safetensors")]
    (out / "index.json").write_text(json.dumps(index))
    result = embed(setup, out, "--ray", cluster, "--batch", "2", inputs=[str(listing)])
    assert result.returncode == 1, result.stderr
    assert "skipping 7 images" in result.stderr and "took back 2 images" in result.stderr
    assert "embedded 2 images" in result.stdout and "failed 3" in result.stdout
    assert_rows_equal_run(embedded_rows(out), reference, images)
    # a listed shard deleted: its images are embedded again
    (out / "shard-00003.safetensors").unlink()
    result = embed(setup, out, "--ray", cluster, "--batch", "2", inputs=[str(listing)])
    assert "2 images are listed in shards missing or damaged" in result.stderr and "skipping 7 images" in result.stderr
    assert "embedded 2 images" in result.stdout
    assert_rows_equal_run(embedded_rows(out), reference, images)
    result = embed(setup, out, "--ray", cluster, "--batch", "2", "--retry-failed", inputs=[str(listing)])
    assert "skipping 6 images" in result.stderr and "failed 3" in result.stdout


def descendants(pid: int) -> list[int]:
    """This machine's processes below `pid` (Linux /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def map_workers() -> list[int]:
    """Pids of this test's Ray cluster's map actors (their process title names them)."""
    pids = []
    for pid in descendants(os.getpid()):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::MapWorker"):
                pids.append(pid)
        except OSError:
            continue
    return pids


def test_ray_actor_killed_mid_run(setup, tmp_path, cluster):
    """SIGKILL one actor once shards come in: Ray restarts it and retries its batch; the
    job completes, every image once, rows equal to run's."""
    root, images, _, reference = setup
    many = [str(tmp_path / f"copy{i}" / Path(images[i % 6]).name) for i in range(48)]
    for path, source in zip(many, [images[i % 6] for i in range(48)]):
        Path(path).parent.mkdir()
        Path(path).write_bytes(Path(source).read_bytes())
    out = tmp_path / "out"
    proc = subprocess.Popen([QWEN3VL, "embed", "--model", str(root / "model"), str(tmp_path), "-o", str(out),
                             *BUCKETS, "--cache-dir", setup[2], "--no-progress", "--batch", "1", "--ray", cluster],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = None
    while proc.poll() is None and killed is None:
        workers = map_workers()
        if workers and len(list(out.glob("shard-*.safetensors"))) >= 2:
            killed = workers[0]
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.02)
    stdout, stderr = proc.communicate(timeout=300)
    assert killed is not None, "finished before an actor could be killed"
    assert proc.returncode == 0, stderr
    assert "embedded 48 images" in stdout
    rows = embedded_rows(out)
    assert sorted(rows) == sorted(many)
    for path in many:
        source = images[[Path(i).name for i in images].index(Path(path).name)]
        assert rel_l2(rows[path], reference[source]) <= 1e-6
