"""The vision tower as two (or more) source trees emit it, alternating in one process, over
one archive and the same inputs: each tree emits `emit_vision_module` for `--bucket`
(weights from parameters) and compiles it with its own flags; the modules are timed on the
processed `--images`, the order shuffled each round, and each round's ratio to the first
tree is reported beside the medians, with each module's output against the first's.

    git worktree add --detach ../before b4fac87       # static rows, unrolled query chunks
    .venv/bin/python benchmarks/lab/ab_vision_trees.py ../before . --bucket 512 --images 256x256,256x256
    .venv/bin/python benchmarks/lab/ab_vision_trees.py ../before . --bucket 8192 --images 1920x1080 --rounds 2

The images must fill the bucket's row units exactly (as above: 512 and 8192 rows), so that a
tree whose rows are static (the bucket's) takes the same inputs. A benchmark, not a test;
nothing imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from emitter.config import PRESETS, weight_schema  # noqa: E402
from emitter.vision import graph_weights  # noqa: E402
from runtime.artifact.archive import open_archive, release_mapped_pages, write_archive  # noqa: E402
from runtime.artifact.compiler import resolve_precision  # noqa: E402
from runtime.artifact.iree_module import LoadedModule, device_config, parameters_module  # noqa: E402
from runtime.bench.vision import parse_sizes, processed_images  # noqa: E402
from runtime.checkpoints.synthetic import random_vision_weights  # noqa: E402
from runtime.checkpoints.vision import weights_in_order  # noqa: E402
from runtime.inputs.packing import host_inputs  # noqa: E402
from runtime.vision import set_thread_count  # noqa: E402

BUILD = """
import json, resource, sys, time
from emitter.config import PRESETS
from emitter.vision import emit_vision_module
from runtime.artifact.compiler import compile_mlir, resolve_precision
preset, bucket, precision, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
text = emit_vision_module(PRESETS[preset], bucket, precision=resolve_precision(precision, "llvm-cpu"),
                          weights="parameters")
start = time.perf_counter()
open(out, "wb").write(compile_mlir(text))
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"mlir_mb": round(len(text) / 1e6, 2), "compile_wall_s": round(time.perf_counter() - start, 1),
                  "compile_cpu_s": round(usage.ru_utime + usage.ru_stime, 1)}))
"""


def build(tree: Path, preset: str, bucket: int, precision: str, out: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", BUILD, preset, str(bucket), precision, str(out)], cwd=tree,
                          env=dict(os.environ, PYTHONPATH=str(tree)), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{tree}: build failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs="+", type=Path, help="source trees; ratios are to the first")
    p.add_argument("--preset", default="qwen3-vl-2b", choices=sorted(PRESETS))
    p.add_argument("--bucket", type=int, default=512)
    p.add_argument("--images", default="256x256,256x256", help="WxH,... packed in one call")
    p.add_argument("--precision", default="f32")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    set_thread_count(args.threads)
    cfg, precision = PRESETS[args.preset], resolve_precision(args.precision, "llvm-cpu")
    pixels, grid_thw = processed_images(parse_sizes(args.images, "--images"))
    grids = [tuple(int(v) for v in g) for g in grid_thw]
    merged = len(pixels) // cfg.merge_unit
    with tempfile.TemporaryDirectory(prefix="ab_vision_trees.") as work:
        built = {}
        for i, tree in enumerate(args.trees):
            built[i] = build(tree.resolve(), args.preset, args.bucket, args.precision, Path(work) / f"{i}.vmfb")
            print(f"{tree}: {json.dumps(built[i])}", flush=True)
        weights = random_vision_weights(cfg, seed=0)
        ordered = weights_in_order({n: weights[n].reshape(s) for n, s in weight_schema(cfg)}, cfg, precision)
        archive = Path(work) / "weights.irpa"
        write_archive(archive, [(w.name, a) for w, a in zip(graph_weights(cfg, precision), ordered)], cfg, precision)
        del weights, ordered
        inputs = host_inputs(pixels, grids, cfg, args.bucket)
        if len(inputs[0]) != args.bucket:
            raise SystemExit(f"--images {args.images}: {len(pixels)} patches make {len(inputs[0])} rows; a tree with "
                             f"static rows takes {args.bucket}: choose images that fill the bucket's row units")
        index = open_archive(archive, cfg, precision)
        config = device_config("llvm-cpu")
        modules = []
        for i in range(len(args.trees)):
            module = LoadedModule((Path(work) / f"{i}.vmfb").read_bytes(), config=config,
                                  modules=[parameters_module(config, index)])
            modules.append((module, [module.upload(x) for x in inputs]))
        release_mapped_pages(index)
        times, outputs = [[] for _ in modules], [None] * len(modules)
        order = list(range(len(modules)))
        for r in range(args.rounds + 1):  # the first round warms up
            random.Random(r).shuffle(order)
            for i in order:
                module, device_inputs = modules[i]
                start = time.perf_counter()
                out = module(*device_inputs)
                if r:
                    times[i].append(time.perf_counter() - start)
                outputs[i] = out[0][:merged]
    first = times[0]
    for i, tree in enumerate(args.trees):
        err = np.linalg.norm(outputs[i] - outputs[0]) / np.linalg.norm(outputs[0])
        ratios = [t / f for t, f in zip(times[i], first)]
        print(f"{tree}: median {statistics.median(times[i]):.3f} s (min {min(times[i]):.3f}), "
              f"x{statistics.median(times[i]) / statistics.median(first):.3f} the first "
              f"(per round {min(ratios):.3f}-{max(ratios):.3f}), relL2 to the first {err:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
