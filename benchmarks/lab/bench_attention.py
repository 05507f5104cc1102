"""The attention core alone, in each form the graph could take, on this machine's IREE:
time (alternating in one process), peak memory (each form in its own process) and the
score FLOPs each form does against the FLOPs the segments need.

    .venv/bin/python benchmarks/lab/bench_attention.py --buckets 1024 4096 --images 1 4

Forms: "dense" (one [H, B, B] score tensor, the graph's form for small buckets),
"qchunk" (a loop over query chunks, scores [H, C, B], exact row softmax, same FLOPs as
dense), "blockwise" (query chunks with an online softmax over only the key chunks of
their segments: `attention.blockwise_attention`, the graph's form for large buckets),
"fused" (IREE's `iree_linalg_ext.attention` with the [B, B] additive mask), and
"per-segment" (the dense form at each image's size, one call per image: what per-image
calls would cost). Every form is checked against numpy on the same inputs.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

from emitter.builder import Builder, Value
from emitter.attention import (ATTENTION_CHUNK, blockwise_attention, dense_attention, key_ranges, segment_mask,
                            _i32, _pad_rows)
from emitter.vision import render_functions

FORMS = ("dense", "qchunk", "blockwise", "fused", "per-segment")


def qchunk_attention(b: Builder, q, k, v, segment_ids, chunk: int):
    """A loop over query chunks, each with scores [H, C, B] and an exact row softmax."""
    heads, n, d = q.shape
    padded = -(-n // chunk) * chunk
    q, k, v = (_pad_rows(b, x, 1, padded - n, 0.0, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    segments = _pad_rows(b, segment_ids, 0, padded - n, -1, "segments")
    zero = _i32(b, 0)

    def body(i, out):
        start = b.multiply(i, _i32(b, chunk))
        q_c = b.optimization_barrier(b.dynamic_slice(q, [zero, start, zero], (heads, chunk, d)))
        seg_q = b.dynamic_slice(segments, [start], (chunk,))
        same = b.compare("EQ", b.broadcast_in_dim(seg_q, (chunk, padded), [0]),
                         b.broadcast_in_dim(segments, (chunk, padded), [1]))
        mask = b.select(same, b.constant(0.0, (chunk, padded)), b.constant(float("-inf"), (chunk, padded)))
        context = dense_attention(b, q_c, k, v, mask, "f32")
        return [b.add(i, _i32(b, 1)), b.dynamic_update_slice(out, context, [zero, start, zero])]

    _, out = b.while_loop([zero, b.constant(0.0, (heads, padded, d))],
                          lambda i, _: b.compare("LT", i, _i32(b, padded // chunk)), body)
    return out if padded == n else b.slice(out, (0, 0, 0), (heads, n, d))


def fused_attention(b: Builder, q, k, v, segment_ids):
    """IREE's fused attention op (iree_linalg_ext.attention) with the [B, B] additive mask."""
    heads, n, d = q.shape
    mask = segment_mask(b, segment_ids)
    scale = b.constant(d ** -0.5, (), hint="scale")
    maps = ["(d0, d1, d2)", "(d0, d3, d2)", "(d0, d3, d4)", "()", "(d1, d3)", "(d0, d1, d4)"]
    maps = ", ".join(f"affine_map<(d0, d1, d2, d3, d4) -> {m}>" for m in maps)
    t = q.type
    b.lines += [f"%fused.scale_f32 = tensor.extract {scale}[] : tensor<f32>",
                f"%fused.init = tensor.empty() : {t}",
                f"%fused.out = iree_linalg_ext.attention <indexing_maps = [{maps}]> "
                f"ins({q}, {k}, {v}, %fused.scale_f32, {mask} : {t}, {t}, {t}, f32, {mask.type}) "
                f"outs(%fused.init : {t}) {{\n ^bb0(%s: f32):\n  iree_linalg_ext.yield %s : f32\n}} -> {t}"]
    return Value("fused.out", t)


def emit(form: str, heads: int, n: int, d: int, chunk: int) -> str:
    b = Builder()
    q, k, v = (b.argument(name, (heads, n, d)) for name in "qkv")
    segments = b.argument("segment_ids", (n,), "i32")
    if form in ("dense", "per-segment"):
        out = dense_attention(b, q, k, v, segment_mask(b, segments), "f32")
    elif form == "qchunk":
        out = qchunk_attention(b, q, k, v, segments, chunk)
    elif form == "blockwise":
        out = blockwise_attention(b, q, k, v, key_ranges(b, segments, chunk), "f32")
    else:
        out = fused_attention(b, q, k, v, segments)
    function = {"name": "main", "arguments": b.arguments, "results": [("context", out)], "body": b.lines}
    return render_functions([function], b.globals)


def segment_sizes(n: int, images: int) -> list[int]:
    return [n // images + (1 if i < n % images else 0) for i in range(images)]


def inputs(heads: int, n: int, d: int, sizes, seed: int = 0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((heads, n, d), dtype=np.float32) for _ in range(3))
    segments = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
    return q, k, v, segments


def reference(q, k, v, segments) -> np.ndarray:
    out = np.empty_like(q)
    for s in np.unique(segments):
        rows = np.flatnonzero(segments == s)
        scores = np.einsum("hid,hjd->hij", q[:, rows].astype(np.float64), k[:, rows].astype(np.float64))
        scores *= q.shape[2] ** -0.5
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, rows] = np.einsum("hij,hjd->hid", p / p.sum(-1, keepdims=True), v[:, rows].astype(np.float64))
    return out


def score_flops(form: str, sizes, heads: int, d: int, chunk: int) -> float:
    """Multiply-adds x 2 of q.k and p.v that the form does."""
    n = sum(sizes)
    if form in ("dense", "qchunk", "fused"):
        return 4.0 * heads * d * n * n
    if form == "per-segment":
        return 4.0 * heads * d * sum(s * s for s in sizes)
    segments = np.repeat(np.arange(len(sizes)), sizes)
    padded = -(-n // chunk) * chunk
    segments = np.concatenate([segments, np.full(padded - n, -1)])
    blocks = 0
    for i in range(padded // chunk):
        rows = np.isin(segments, segments[i * chunk:(i + 1) * chunk])
        first, last = np.flatnonzero(rows)[[0, -1]]
        blocks += (last // chunk + 1) - first // chunk
    return 4.0 * heads * d * chunk * chunk * blocks


class Runner:
    """A compiled form, callable on the numpy inputs (per-segment: one call per image)."""

    def __init__(self, form, heads, n, d, sizes, chunk):
        from runtime.artifact.compiler import compile_mlir
        from runtime.artifact.iree_module import LoadedModule
        self.form, self.sizes = form, sizes
        shapes = sorted(set(sizes)) if form == "per-segment" else [n]
        start = time.perf_counter()
        self.modules = {s: LoadedModule(compile_mlir(emit(form, heads, s, d, chunk))) for s in shapes}
        self.compile_s = time.perf_counter() - start

    def __call__(self, q, k, v, segments):
        if self.form != "per-segment":
            return self.modules[len(segments)](q, k, v, segments)[0]
        parts, start = [], 0
        for s in self.sizes:
            rows = slice(start, start + s)
            parts.append(self.modules[s](np.ascontiguousarray(q[:, rows]), np.ascontiguousarray(k[:, rows]),
                                         np.ascontiguousarray(v[:, rows]), np.zeros(s, np.int32))[0])
            start += s
        return np.concatenate(parts, axis=1)


def high_water_rss() -> int:
    """This process's peak RSS in bytes (VmHWM: unlike ru_maxrss, not inherited across exec)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_one(form, heads, n, d, images, chunk) -> dict:
    """In this process: compile, load, one call; peak RSS growth over the call."""
    sizes = segment_sizes(n, images)
    arrays = inputs(heads, n, d, sizes)
    run = Runner(form, heads, n, d, sizes, chunk)
    before = high_water_rss()
    run(*arrays)
    after = high_water_rss()
    return {"form": form, "peak_growth_bytes": after - before, "peak_rss_bytes": after}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--buckets", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--images", type=int, nargs="+", default=[1, 4], help="equal images per bucket")
    p.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    p.add_argument("--chunk", type=int, default=ATTENTION_CHUNK)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-memory", action="store_true", help="skip the per-form peak memory processes")
    p.add_argument("--peak-one", nargs=3, metavar=("FORM", "BUCKET", "IMAGES"), help=argparse.SUPPRESS)
    p.add_argument("--json")
    args = p.parse_args(argv)
    from runtime.vision import set_thread_count
    set_thread_count(args.threads)
    h, d = args.heads, args.head_dim
    if args.peak_one:
        form, n, images = args.peak_one[0], int(args.peak_one[1]), int(args.peak_one[2])
        print(json.dumps(peak_one(form, h, n, d, images, args.chunk)))
        return
    rows = []
    for n in args.buckets:
        for images in args.images:
            sizes = segment_sizes(n, images)
            arrays = inputs(h, n, d, sizes)
            expected = reference(*arrays)
            runners = {form: Runner(form, h, n, d, sizes, args.chunk) for form in args.forms}
            errors = {}
            for form, run in runners.items():
                out = run(*arrays)
                errors[form] = float(np.linalg.norm(out - expected) / np.linalg.norm(expected))
            times = {form: [] for form in runners}
            for _ in range(args.repeats):
                for form, run in runners.items():
                    start = time.perf_counter()
                    run(*arrays)
                    times[form].append(time.perf_counter() - start)
            base = statistics.median(times[args.forms[0]])
            needed = score_flops("per-segment", sizes, h, d, args.chunk)
            for form in runners:
                peak = None
                if not args.no_memory:
                    out = subprocess.run([sys.executable, __file__, "--heads", str(h), "--head-dim", str(d),
                                          "--chunk", str(args.chunk), "--threads", str(args.threads),
                                          "--peak-one", form, str(n), str(images)],
                                         check=True, capture_output=True, text=True).stdout
                    peak = json.loads(out.strip().splitlines()[-1])["peak_growth_bytes"]
                seconds = statistics.median(times[form])
                done = score_flops(form, sizes, h, d, args.chunk)
                rows.append({"bucket": n, "images": images, "form": form, "seconds": seconds,
                             "x_first_form": seconds / base, "gflop_done": done / 1e9, "gflop_needed": needed / 1e9,
                             "gflops_needed_rate": needed / seconds / 1e9, "peak_growth_bytes": peak,
                             "rel_l2": errors[form], "compile_s": runners[form].compile_s})
                r = rows[-1]
                mem = "-" if peak is None else f"{peak / 1e9:.2f}"
                print(f"B={n:>6} images={images:>2} {form:<12} {seconds:8.3f} s  x{r['x_first_form']:5.2f}  "
                      f"done/needed {done / needed:5.2f}  {r['gflops_needed_rate']:6.1f} GFLOP/s (needed)  "
                      f"peak +{mem} GB  relL2 {r['rel_l2']:.1e}", flush=True)
            del runners
    if args.json:
        from emitter.atomic import write_atomic
        write_atomic(args.json, json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
