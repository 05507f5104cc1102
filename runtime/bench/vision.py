"""`qwen3vl bench`: the compiled vision tower against transformers' tower and the machine's
matmul roof, in one process.

Same weights, same processed images, same thread count. The programs run in a random
order each round (seeded), after warm-up rounds; each is reported as min / median / max,
and each ratio also as the range of the per-round ratios. transformers runs with its
default attention (sdpa) under `torch.inference_mode()`, f32 against our f32 and bf16
against our bf16 (`--precision both` does both in one run). The roof (runtime/bench/roof.py) is
measured in the same run. torch and transformers are optional: without them the bench
says so and times our side against the roof. `--end-to-end` also times what `qwen3vl run`
does per call on image files (a VisionSession: processing, host inputs, upload, the call,
outputs) against the bare graph call.

    qwen3vl bench --preset qwen3-vl-2b --bucket 512 --precision both --json bench.json
    qwen3vl bench --preset tiny --bucket 64 --images 64x64 --roof-sizes 256

`run(BenchOptions(...))` returns the figures; runtime/commands/bench.py is the command.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from emitter.atomic import check_writable, write_atomic
from emitter.config import CONV_WEIGHT, PRESETS, ROPE_THETA, VisionConfig, weight_schema
from emitter.config import HF_PREFIX
from emitter.vision import graph_weights as graph_weight_specs

from runtime.artifact.compiler import resolve_precision
from runtime.bench.roof import DEFAULT_SIZES, measure_roof

PRECISIONS = {"f32": ("f32",), "bf16": ("bf16",), "both": ("f32", "bf16")}


def vision_flops(cfg: VisionConfig, grids) -> float:
    """Multiply-adds x 2 of the work the tower must do on these images (attention only
    within each frame), counted analytically; padding is not counted."""
    n = sum(t * h * w for t, h, w in grids)
    h, i, h4, out = cfg.hidden_size, cfg.intermediate_size, cfg.merged_hidden_size, cfg.out_hidden_size
    per_block = 2 * n * h * (3 * h + h + 2 * i)  # qkv, proj, fc1, fc2
    per_block += sum(t * 2 * 2 * (hh * ww) ** 2 * h for t, hh, ww in grids)  # q.k and p.v per frame
    mergers = (1 + len(cfg.deepstack_visual_indexes)) * 2 * (n // 4) * h4 * (h4 + out)
    return cfg.depth * per_block + 2 * n * cfg.patch_dim * h + mergers


def shallower(cfg: VisionConfig, depth: int | None) -> VisionConfig:
    """`cfg` with only its first `depth` blocks (and the DeepStack taps among them): the same
    kernels at a fraction of the memory and time, for A/B runs of the per-block work."""
    if not depth:
        return cfg
    import dataclasses
    return dataclasses.replace(cfg, depth=depth,
                               deepstack_visual_indexes=tuple(i for i in cfg.deepstack_visual_indexes if i < depth))


def parse_sizes(text: str, flag: str) -> list[tuple[int, int]]:
    """'256x256,128x64' -> [(256, 256), (128, 64)] (width, height)."""
    try:
        sizes = [tuple(int(v) for v in s.split("x")) for s in text.split(",")]
        if all(len(s) == 2 and min(s) > 0 for s in sizes):
            return sizes
    except ValueError:
        pass
    raise ValueError(f"{flag} {text}: expected comma-separated WxH sizes, e.g. 256x256,256x256")


def parse_roof_sizes(text: str) -> list[int]:
    try:
        sizes = [int(n) for n in text.split(",")]
        if all(n > 0 for n in sizes):
            return sizes
    except ValueError:
        pass
    raise ValueError(f"--roof-sizes {text}: expected comma-separated matmul sizes, e.g. 2048,4096")


def random_images(sizes, seed: int = 0):
    from PIL import Image
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def processed_images(sizes, seed=0, policy=None):
    """Random RGB images of `sizes` through the processor: (pixel_values, grid_thw)."""
    from emitter.policy import DEFAULT_POLICY
    from runtime.inputs.processor import process_images
    return process_images(random_images(sizes, seed), policy or DEFAULT_POLICY)


# ---------------------------------------------------------------------------------------------
# transformers' tower (optional)


def import_transformers_tower():
    """(Qwen3VLVisionModel, Qwen3VLVisionConfig), or a string saying why not. In a source
    checkout the test harness's torchvision shim is loaded first (tests/torch_reference.py)."""
    try:
        importlib.import_module("torch")
    except ImportError:
        return "torch is not installed"
    harness = Path(__file__).resolve().parents[2] / "tests"
    if (harness / "torch_reference.py").is_file() and str(harness) not in sys.path:
        sys.path.append(str(harness))
        try:
            importlib.import_module("torch_reference")  # lets torchvision import beside a CPU torch
        except Exception:
            pass
    try:
        from transformers import Qwen3VLVisionConfig, Qwen3VLVisionModel
        return Qwen3VLVisionModel, Qwen3VLVisionConfig
    except Exception as e:  # ImportError, or torchvision's RuntimeError
        return f"transformers' Qwen3-VL does not import ({str(e).splitlines()[0]})"


def transformers_tower(classes, cfg: VisionConfig, weights: dict, precision: str):
    """A callable (pixel_values, grid_thw) -> image_embeds running transformers' tower with
    its default attention implementation, in `precision`, under inference_mode."""
    import torch

    model_class, config_class = classes
    kwargs = cfg.to_hf_vision_config()
    if cfg.rope_theta != ROPE_THETA:
        kwargs["rope_parameters"] = {"rope_type": "axial", "rope_theta": float(cfg.rope_theta)}
    model = model_class(config_class(**kwargs)).eval()
    model.load_state_dict({name[len(HF_PREFIX):]: torch.from_numpy(np.array(w, np.float32))
                           for name, w in weights.items()}, strict=True)
    dtype = torch.float32 if precision == "f32" else torch.bfloat16
    model = model.to(dtype)

    def run(pixels, grid_thw):
        with torch.inference_mode():
            out = model(torch.from_numpy(pixels).to(dtype), grid_thw=torch.from_numpy(np.asarray(grid_thw)))
            return out.pooler_output.float().numpy()
    run.attention = model.config._attn_implementation
    return run


# ---------------------------------------------------------------------------------------------
# Our side


def our_tower(cfg, weights, bucket, precision, binding, flags, config, inputs, workdir):
    """Emit, compile and load the graph; a callable running it on device-resident inputs,
    returning image_embeds trimmed to the real rows; and its build figures. Parameter-bound
    weights are served as a session serves them: from an archive written in `workdir`,
    memory-mapped (numpy arrays served from memory instead made a 2B f32 call 4-9% slower,
    docs/history/performance-notebook.md)."""
    from emitter.vision import emit_vision_module
    from runtime.artifact.archive import open_archive, release_mapped_pages, write_archive
    from runtime.checkpoints.vision import weights_in_order
    from runtime.artifact.compiler import compile_mlir
    from runtime.artifact.iree_module import LoadedModule, parameters_module

    ordered = weights_in_order({name: weights[name].reshape(shape) for name, shape in weight_schema(cfg)},
                               cfg, precision)
    keep = [ordered]
    start = time.perf_counter()
    text = emit_vision_module(cfg, bucket, precision=precision, weights=binding)
    emitted = time.perf_counter()
    vmfb = compile_mlir(text, extra_flags=flags)
    compiled = time.perf_counter()
    if binding == "parameters":
        archive = os.path.join(workdir, f"weights-{precision}.irpa")
        write_archive(archive, [(w.name, a) for w, a in zip(graph_weight_specs(cfg, precision), ordered)],
                      cfg, precision)
        index = open_archive(archive, cfg, precision)
        module, device_weights = LoadedModule(vmfb, config=config, modules=[parameters_module(config, index)]), []
        release_mapped_pages(index)  # packed at load, as in a session
        keep.append(index)
    else:
        module = LoadedModule(vmfb, config=config)
        device_weights = [module.upload(w) for w in ordered]
    device_inputs = [module.upload(x) for x in inputs]
    merged = len(inputs[0]) // cfg.merge_unit  # the call's rows, merged

    def run():
        return module(*device_inputs, *device_weights)[0][:merged]
    run.keep = keep  # what the module reads from: the archive's index, the weights' arrays
    figures = {"emit_s": emitted - start, "compile_s": compiled - emitted, "vmfb_bytes": len(vmfb),
               "weights_bytes": sum(w.nbytes for w in ordered)}
    return run, figures


def end_to_end(args, cfg, precision, images, workdir):
    """What `qwen3vl run` does per call, on image files: a VisionSession (one bucket) whose
    encode() processes, packs, uploads, calls and returns the outputs."""
    from runtime.vision import VisionSession
    from runtime.checkpoints.synthetic import write_checkpoint

    model = args.model
    if not model:
        model = os.path.join(workdir, "checkpoint")
        write_checkpoint(model, cfg, seed=0)
    paths = []
    for i, image in enumerate(images):
        paths.append(os.path.join(workdir, f"image{i}.png"))
        image.save(paths[-1])
    session = VisionSession(model, buckets=[args.bucket], cache_dir=args.cache_dir or os.path.join(workdir, "cache"),
                            threads=args.threads, precision=precision, weights=args.weights)
    session.module(args.bucket)  # compiled (or from the cache) and loaded, outside the clock
    return lambda: session.encode(paths).image_embeds


# ---------------------------------------------------------------------------------------------
# Timing


def alternate(programs: dict, warmup: int, repeats: int, seed: int = 0) -> dict[str, list[float]]:
    """Every program once per round, in a fresh random order each round; times of the
    rounds after `warmup`."""
    order, times = list(programs), {name: [] for name in programs}
    shuffle = random.Random(seed).shuffle
    for i in range(warmup + repeats):
        shuffle(order)
        for name in order:
            start = time.perf_counter()
            programs[name]()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def spread(times) -> dict:
    return {"min": min(times), "median": statistics.median(times), "max": max(times)}


def ratio_figures(times, slow: str, fast: str) -> dict:
    """median(slow) / median(fast), and the range of the per-round ratios."""
    rounds = [s / f for s, f in zip(times[slow], times[fast])]
    return {"ratio": statistics.median(times[slow]) / statistics.median(times[fast]),
            "min": min(rounds), "max": max(rounds)}


def rel_l2(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchOptions:
    """What `qwen3vl bench` was asked (runtime/commands/bench.py gives each its flag and help)."""
    preset: str = "qwen3-vl-2b"
    model: str | None = None
    bucket: int = 512
    images: str = "256x256,256x256"
    repeats: int = 7
    warmup: int = 2
    threads: int = 2
    precision: str = "f32"
    weights: str = "parameters"
    flags: tuple[str, ...] = ()
    no_torch: bool = False
    roof_sizes: str = ",".join(map(str, DEFAULT_SIZES))
    end_to_end: bool = False
    cache_dir: str | None = None
    seed: int = 0
    json: str | None = None


def load_model(args):
    """(cfg, pixel_values, grid_thw, weights by HF name, the images)."""
    sizes = parse_sizes(args.images, "--images")
    images = random_images(sizes)
    from runtime.inputs.processor import process_images
    if args.model:
        from emitter.config import load_model_config
        from emitter.policy import load_policy
        from runtime.checkpoints.vision import load_vision_weights
        cfg = load_model_config(args.model)
        pixels, grid_thw = process_images(images, load_policy(args.model))
        weights = {name: (w.reshape(cfg.conv_shape) if name == CONV_WEIGHT else w)
                   for name, w in load_vision_weights(args.model, cfg).items()}
    else:
        from emitter.policy import DEFAULT_POLICY
        from runtime.checkpoints.synthetic import random_vision_weights
        if args.preset not in PRESETS:
            raise ValueError(f"--preset {args.preset}: unknown; expected one of {', '.join(PRESETS)}")
        cfg = PRESETS[args.preset]
        pixels, grid_thw = process_images(images, DEFAULT_POLICY)
        weights = random_vision_weights(cfg, seed=0)
    return cfg, pixels, grid_thw, weights, images


def run(args: BenchOptions) -> dict:
    """Every figure of one bench run (module docstring); `args.json` written too. Bad input
    is a ValueError (or OSError), raised before any work."""
    from runtime.inputs.packing import PackingError, host_inputs
    from runtime.vision import set_thread_count
    if args.precision not in PRECISIONS:
        raise ValueError(f"--precision {args.precision}: expected one of {', '.join(PRECISIONS)}")
    if args.json:
        check_writable(args.json, "--json")
    roof_sizes = parse_roof_sizes(args.roof_sizes)
    set_thread_count(args.threads)
    cfg, pixels, grid_thw, weights, images = load_model(args)
    try:
        inputs = host_inputs(pixels, [tuple(int(v) for v in g) for g in grid_thw], cfg, args.bucket)
    except PackingError as e:
        raise ValueError(f"--bucket {args.bucket}: the images of --images {args.images} do not fit ({e})") from None
    with tempfile.TemporaryDirectory(prefix="qwen3vl-bench-") as workdir:
        figures = run_bench(args, cfg, pixels, grid_thw, weights, images, inputs, roof_sizes, workdir)
    if args.json:
        write_atomic(args.json, json.dumps(figures, indent=1) + "\n")
    return figures


def run_bench(args, cfg, pixels, grid_thw, weights, images, inputs, roof_sizes, workdir) -> dict:
    from runtime.artifact.iree_module import device_config

    precisions = PRECISIONS[args.precision]
    grids = [tuple(int(v) for v in g) for g in grid_thw]
    config = device_config("llvm-cpu")  # as a session makes it (glibc keeps freed transients)
    merged = len(pixels) // cfg.merge_unit
    programs, figures = {}, {}
    # Our bf16 in the host's form (`emitter.identity.bf16_form`), as the commands run it.
    forms = {precision: resolve_precision(precision, "llvm-cpu", print) for precision in precisions}
    figures["graph_precisions"] = {asked: form.name for asked, form in forms.items()}
    for precision in precisions:
        run, built = our_tower(cfg, weights, args.bucket, forms[precision], args.weights, args.flags, config,
                               inputs, workdir)
        programs[f"ours {precision}"] = lambda run=run: run()[:merged]
        figures.update({f"{k}_{precision}" if precision != "f32" else k: v for k, v in built.items()})
    torch_status = "not asked (--no-torch)" if args.no_torch else import_transformers_tower()
    attention = None
    if not isinstance(torch_status, str):
        import torch
        torch.set_num_threads(args.threads)
        for precision in precisions:
            tower = transformers_tower(torch_status, cfg, weights, precision)
            attention = tower.attention
            programs[f"torch {precision}"] = lambda tower=tower: tower(pixels, grid_thw)
        reference = programs["torch f32"]() if "torch f32" in programs else \
            transformers_tower(torch_status, cfg, weights, "f32")(pixels, grid_thw)
        torch_status = f"transformers, {attention} attention, inference_mode"
    if args.end_to_end:
        programs[f"ours {precisions[0]} end to end"] = end_to_end(args, cfg, precisions[0], images, workdir)

    outputs = {name: fn() for name, fn in programs.items()}
    times = alternate(programs, args.warmup, args.repeats, args.seed)
    roof = measure_roof(config, args.threads, roof_sizes, forms, with_torch=attention is not None)
    flops = vision_flops(cfg, grids)

    figures.update({
        "preset": None if args.model else args.preset, "model": args.model, "bucket": args.bucket,
        "images": args.images, "threads": args.threads, "precision": args.precision, "weights": args.weights,
        "flags": args.flags, "torch": torch_status, "order": f"random per round (seed {args.seed})",
        "warmup": args.warmup, "repeats": args.repeats, "loadavg": list(os.getloadavg()),
        "gflop": flops / 1e9, "times": times, "roof": roof,
        "roof_gflops": roof.get("f32", {}).get("gflops"), "roof_bf16_gflops": roof.get("bf16", {}).get("gflops"),
    })
    for precision in ("f32", "bf16"):
        tag = "" if precision == "f32" else "_bf16"
        ours, peer = f"ours {precision}", f"torch {precision}"
        figures.update({f"ours{tag}_s": None, f"torch{tag}_s": None, f"ratio{tag}": None})
        if ours not in times:
            figures.update({f"gflops{tag}" if tag else "gflops": None, f"roof{tag}_fraction": None})
            continue
        s = spread(times[ours])
        figures.update({f"ours{tag}_s": s["median"], f"ours{tag}_min_s": s["min"], f"ours{tag}_max_s": s["max"],
                        f"gflops{tag}" if tag else "gflops": flops / s["median"] / 1e9})
        figures[f"roof{tag}_fraction"] = flops / s["median"] / 1e9 / roof[precision]["gflops"]
        if peer in times:
            p = spread(times[peer])
            r = ratio_figures(times, peer, ours)
            figures.update({f"torch{tag}_s": p["median"], f"torch{tag}_min_s": p["min"],
                            f"torch{tag}_max_s": p["max"], f"ratio{tag}": r["ratio"],
                            f"ratio{tag}_min": r["min"], f"ratio{tag}_max": r["max"],
                            f"rel_l2{tag}_vs_torch_f32": rel_l2(outputs[ours], reference)})
            if precision == "bf16":
                figures["rel_l2_torch_bf16_vs_torch_f32"] = rel_l2(outputs[peer], reference)
    if "rel_l2_vs_torch_f32" in figures:
        figures["rel_l2_vs_torch"] = figures["rel_l2_vs_torch_f32"]  # the name earlier runs used
    e2e = f"ours {precisions[0]} end to end"
    if e2e in times:
        r = ratio_figures(times, e2e, f"ours {precisions[0]}")
        figures.update({"e2e_s": statistics.median(times[e2e]), "e2e_overhead": r["ratio"] - 1,
                        "e2e_overhead_min": r["min"] - 1, "e2e_overhead_max": r["max"] - 1,
                        "rel_l2_e2e_vs_graph": rel_l2(outputs[e2e], outputs[f"ours {precisions[0]}"])})
    figures["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return figures


def report(f: dict) -> str:
    """The figures of `run` as the command prints them."""
    flops = f["gflop"] * 1e9
    lines = [f"{f['model'] or f['preset']}, bucket {f['bucket']}, images {f['images']}, {f['threads']} threads, "
             f"{f['gflop']:.0f} GFLOP of work, weights {f['weights']}, flags {f['flags'] or 'default'}, "
             f"load average {f['loadavg'][0]:.2f}",
             f"  peer: {f['torch']}; order {f['order']}, {f['warmup']} warm-up + {f['repeats']} timed rounds"]
    for name, t in f["times"].items():
        s = spread(t)
        lines.append(f"  {name:<24} median {s['median']:8.3f} s  (min {s['min']:.3f}, max {s['max']:.3f})  "
                     f"{flops / s['median'] / 1e9:6.0f} GFLOP/s")
    for precision, roof in f["roof"].items():
        tag = "" if precision == "f32" else "_bf16"
        form = f["graph_precisions"].get(precision, precision)
        line = (f"  {precision}{f' (built as {form})' if form != precision else ''}: "
                f"roof {roof['gflops']:.0f} GFLOP/s ({roof['by']})")
        if f[f"ours{tag}_s"] is not None:
            line += f"; ours at {f[f'roof{tag}_fraction']:.0%} of it"
        if f[f"ratio{tag}"] is not None:
            line += (f"; torch {precision} / ours {f[f'ratio{tag}']:.2f}x (rounds {f[f'ratio{tag}_min']:.2f}-"
                     f"{f[f'ratio{tag}_max']:.2f}), rel L2 vs torch f32 {f[f'rel_l2{tag}_vs_torch_f32']:.1e}")
        lines.append(line)
    if "e2e_s" in f:
        lines.append(f"  end to end (VisionSession.encode on files) vs graph: {f['e2e_overhead']:+.1%} "
                     f"(rounds {f['e2e_overhead_min']:+.1%} to {f['e2e_overhead_max']:+.1%})")
    lines.append(f"  emit {f['emit_s']:.3f} s, compile {f['compile_s']:.1f} s, vmfb {f['vmfb_bytes'] / 1e6:.2f} MB, "
                 f"weights {f['weights_bytes'] / 1e9:.2f} GB, peak RSS {f['peak_rss_bytes'] / 1e9:.2f} GB"
                 if "emit_s" in f else f"  peak RSS {f['peak_rss_bytes'] / 1e9:.2f} GB")
    return "\n".join(lines)
