"""A/B timing of IREE runtime settings (thread count, task topology, worker spin), which
are fixed per process: one worker process per setting, each holding the same compiled
tower, called one at a time in a random order each round, so the settings see the same
machine load.

    .venv/bin/python benchmarks/lab/ab_runtime.py task_topology_group_count=2 \\
        "task_topology_group_count=2 task_worker_spin_us=100" task_topology_group_count=1

Each argument is one setting: IREE runtime flags without their leading dashes,
space-separated, parsed before the worker makes its device. The first is the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WORKER = r"""
import json, sys, tempfile, time
import iree.runtime as rt
rt.flags.parse_flags(*json.loads(sys.argv[1]))
from runtime.bench.vision import our_tower, processed_images, shallower
from runtime.artifact.iree_module import device_config
from runtime.inputs.packing import host_inputs
from runtime.checkpoints.synthetic import random_vision_weights
from emitter.config import PRESETS
preset, depth, bucket, images, precision = json.loads(sys.argv[2])
cfg = shallower(PRESETS[preset], depth)
pixels, grid_thw = processed_images([tuple(int(v) for v in s.split("x")) for s in images.split(",")])
inputs = host_inputs(pixels, [tuple(int(v) for v in g) for g in grid_thw], cfg, bucket)
workdir = tempfile.TemporaryDirectory(prefix="ab-runtime-")  # the weight archive, removed at exit
run, _ = our_tower(cfg, random_vision_weights(cfg, seed=0), bucket, precision, "parameters", [],
                   device_config("llvm-cpu"), inputs, workdir.name)
del _
run()
print("ready", flush=True)
for line in sys.stdin:
    start = time.perf_counter()
    run()
    print(time.perf_counter() - start, flush=True)
"""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("settings", nargs="+", help="IREE runtime flags per setting, without dashes, space-separated")
    p.add_argument("--preset", default="qwen3-vl-2b")
    p.add_argument("--bucket", type=int, default=512)
    p.add_argument("--images", default="256x256,256x256")
    p.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--depth", type=int, help="only the first N blocks (same kernels, less memory and time)")
    args = p.parse_args(argv)

    import random
    spec = json.dumps([args.preset, args.depth, args.bucket, args.images, args.precision])
    workers = {}
    for setting in args.settings:  # one at a time: compiles and packs are not timed
        flags = json.dumps([f"--{flag}" for flag in setting.split()])
        worker = subprocess.Popen([sys.executable, "-c", WORKER, flags, spec],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if worker.stdout.readline().strip() != "ready":
            sys.exit(f"error: the worker for {setting!r} failed")
        workers[setting] = worker
    times = {setting: [] for setting in args.settings}
    order = list(args.settings)
    load = os.getloadavg()[0]
    for i in range(args.repeats + 1):
        random.Random(i).shuffle(order)
        for setting in order:
            workers[setting].stdin.write("go\n")
            workers[setting].stdin.flush()
            seconds = float(workers[setting].stdout.readline())
            if i:
                times[setting].append(seconds)
    for worker in workers.values():
        worker.stdin.close()
        worker.wait()
    base = args.settings[0]
    print(f"{args.preset} (depth {args.depth or 'all'}), bucket {args.bucket}, {args.precision}, "
          f"1 warm-up + {args.repeats} rounds in random order, load average {load:.2f} -> {os.getloadavg()[0]:.2f}")
    for setting in args.settings:
        rounds = [b / s for b, s in zip(times[base], times[setting])]
        m = statistics.median(times[setting])
        print(f"  {setting:<60} {m:7.3f} s (min {min(times[setting]):.3f}, max {max(times[setting]):.3f})  "
              f"x{statistics.median(times[base]) / m:5.2f} vs baseline (rounds {min(rounds):.2f}-{max(rounds):.2f})")


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"({time.perf_counter() - started:.0f} s)")
