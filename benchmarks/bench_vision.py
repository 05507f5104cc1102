"""Benchmark the compiled vision tower against transformers' PyTorch tower.

Same random weights, same processed images, same thread count, one process, the two
alternating (the machines are noisy: quote the ratio, not the seconds). torch and
transformers are optional here (the package never imports them); without them only our
side and a numpy matmul ceiling are measured.

    .venv/bin/python benchmarks/bench_vision.py --preset qwen3-vl-2b --bucket 512
    .venv/bin/python benchmarks/bench_vision.py --preset tiny --bucket 64 --images 64x64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # torch_reference (the parity harness) for the peer

from emitter.atomic import check_writable, write_atomic  # noqa: E402
from emitter.cli import fail  # noqa: E402
from emitter.config import CONV_WEIGHT, PRESETS, VisionConfig, weight_schema  # noqa: E402
from emitter.config import graph_weights as graph_weight_specs  # noqa: E402
from emitter.vision import emit_vision_module  # noqa: E402
from runtime.checkpoint import weights_in_order  # noqa: E402
from runtime.compiler import compile_mlir  # noqa: E402
from runtime.packing import host_inputs  # noqa: E402
from runtime.synthetic import random_vision_weights  # noqa: E402


def vision_flops(cfg: VisionConfig, grids, bucket: int) -> float:
    """Multiply-adds x 2 of the work the tower must do on these images (attention only
    within each frame), counted analytically; padding is not counted."""
    n = sum(t * h * w for t, h, w in grids)
    h, i, h4, out = cfg.hidden_size, cfg.intermediate_size, cfg.merged_hidden_size, cfg.out_hidden_size
    per_block = 2 * n * h * (3 * h + h + 2 * i)  # qkv, proj, fc1, fc2
    per_block += sum(t * 2 * 2 * (hh * ww) ** 2 * h for t, hh, ww in grids)  # q.k and p.v per frame
    mergers = (1 + len(cfg.deepstack_visual_indexes)) * 2 * (n // 4) * h4 * (h4 + out)
    return cfg.depth * per_block + 2 * n * cfg.patch_dim * h + mergers


def median_spread(times):
    return statistics.median(times), (max(times) - min(times)) / statistics.median(times)


def matmul_ceiling(threads: int, repeats: int = 7) -> tuple[str, float]:
    """GFLOP/s of a 512x1024 @ 1024x4096 f32 matmul (torch if present, else numpy)."""
    a = np.random.default_rng(0).standard_normal((512, 1024), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((1024, 4096), dtype=np.float32)
    try:
        import torch
        torch.set_num_threads(threads)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        fn, name = (lambda: ta @ tb), "torch"
    except ImportError:
        fn, name = (lambda: a @ b), "numpy"
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return name, 2 * 512 * 1024 * 4096 / statistics.median(times) / 1e9


def processed_images(sizes, seed=0, policy=None):
    from PIL import Image
    from emitter.policy import DEFAULT_POLICY
    from runtime.processor import process_images
    rng = np.random.default_rng(seed)
    pictures = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    return process_images(pictures, policy or DEFAULT_POLICY)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-vl-2b", help="a preset, with random weights")
    p.add_argument("--model", help="a checkpoint folder instead of a preset")
    p.add_argument("--bucket", type=int, default=512)
    p.add_argument("--images", default="256x256,256x256", help="comma-separated WxH sizes")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", choices=["f32", "bf16"], default="f32",
                   help="ours in bf16 matmuls: also times transformers in bf16; errors against f32")
    p.add_argument("--weights", choices=["parameters", "arguments"], default="parameters",
                   help="weight binding (the runtime's default: parameters)")
    p.add_argument("--flag", action="append", default=[], help="extra iree-compile flag (a lever to try)")
    p.add_argument("--no-torch", action="store_true", help="measure our side only")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)

    import iree.runtime as rt
    from runtime.iree_module import LoadedModule, parameters_module
    from runtime.session import set_thread_count

    try:  # before any work
        if args.json:
            check_writable(args.json, "--json")
        set_thread_count(args.threads)
    except ValueError as e:
        fail(str(e))

    sizes = [tuple(int(v) for v in s.split("x")) for s in args.images.split(",")]
    if args.model:  # a checkpoint's config, processor policy and weights
        from emitter.config import load_model_config
        from emitter.policy import load_policy
        from runtime.checkpoint import load_vision_weights
        cfg = load_model_config(args.model)
        pixels, grid_thw = processed_images(sizes, policy=load_policy(args.model))
        weights = {name: (w.reshape(cfg.conv_shape) if name == CONV_WEIGHT else w)
                   for name, w in load_vision_weights(args.model, cfg).items()}
    else:  # a preset with random weights
        cfg = PRESETS[args.preset]
        pixels, grid_thw = processed_images(sizes)
        weights = random_vision_weights(cfg, seed=0)
    grids = [tuple(int(v) for v in g) for g in grid_thw]
    graph_weights = weights_in_order({name: weights[name].reshape(shape) for name, shape in weight_schema(cfg)},
                                     cfg, args.precision)

    start = time.perf_counter()
    text = emit_vision_module(cfg, args.bucket, precision=args.precision, weights=args.weights)
    emit_s = time.perf_counter() - start
    start = time.perf_counter()
    vmfb = compile_mlir(text, extra_flags=args.flag)
    compile_s = time.perf_counter() - start

    config = rt.Config("local-task")
    if args.weights == "parameters":
        params = parameters_module(config, [(w.name, a) for w, a in zip(graph_weight_specs(cfg, args.precision),
                                                                        graph_weights)])
        module = LoadedModule(vmfb, config=config, modules=[params])
        device_weights = []
    else:
        module = LoadedModule(vmfb, config=config)
        device_weights = [module.upload(w) for w in graph_weights]
    inputs = host_inputs(pixels, grids, cfg, args.bucket)
    merged = len(pixels) // cfg.merge_unit

    def ours():
        return module(*inputs, *device_weights)[0][:merged]

    peers = {}  # name -> callable
    if not args.no_torch:
        try:
            import torch
            from torch_reference import load_state_dict, make_vision_model
            torch.set_num_threads(args.threads)
            model = make_vision_model(cfg)
            load_state_dict(model, weights)
            tp, tg = torch.from_numpy(pixels), torch.from_numpy(np.asarray(grid_thw))

            def torch_f32():
                with torch.no_grad():
                    return model(tp, grid_thw=tg).pooler_output.numpy()
            peers["transformers f32"] = torch_f32
            if args.precision == "bf16":
                import copy
                model16 = copy.deepcopy(model).to(torch.bfloat16)

                def torch_bf16():
                    with torch.no_grad():
                        return model16(tp.to(torch.bfloat16), grid_thw=tg).pooler_output.float().numpy()
                peers["transformers bf16"] = torch_bf16
        except ImportError:
            pass

    runs = {"ours (IREE)": ours, **peers}
    times = {name: [] for name in runs}
    for i in range(args.warmup + args.repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    ours_out = ours()
    error = None
    if peers:
        expected = peers["transformers f32"]()
        error = float(np.linalg.norm(ours_out - expected) / np.linalg.norm(expected))
    ours_times = times["ours (IREE)"]
    peer_times = times.get("transformers f32", [])

    flops = vision_flops(cfg, grids, args.bucket)
    ceiling_name, ceiling = matmul_ceiling(args.threads)
    ours_s, ours_spread = median_spread(ours_times)
    figures = {
        "preset": None if args.model else args.preset, "model": args.model, "bucket": args.bucket, "images": args.images, "threads": args.threads,
        "precision": args.precision, "weights": args.weights,
        "flags": args.flag, "ours_s": ours_s, "ours_spread": ours_spread,
        "torch_s": None, "torch_spread": None, "ratio": None, "rel_l2_vs_torch": error,
        "gflop": flops / 1e9, "gflops": flops / ours_s / 1e9, "ceiling_gflops": ceiling, "ceiling_by": ceiling_name,
        "ceiling_fraction": flops / ours_s / 1e9 / ceiling, "emit_s": emit_s, "compile_s": compile_s,
        "vmfb_bytes": len(vmfb), "weights_bytes": sum(w.nbytes for w in graph_weights),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if peer_times:
        torch_s, torch_spread = median_spread(peer_times)
        figures.update(torch_s=torch_s, torch_spread=torch_spread, ratio=torch_s / ours_s,
                       torch_gflops=flops / torch_s / 1e9)

    if "transformers bf16" in times:
        bf16_s, _ = median_spread(times["transformers bf16"])
        figures.update(torch_bf16_s=bf16_s, ratio_vs_torch_bf16=bf16_s / ours_s)
    print(f"{args.model or args.preset}, bucket {args.bucket}, images {args.images}, {args.threads} threads, "
          f"{figures['gflop']:.0f} GFLOP of work, precision {args.precision}, weights {args.weights}, "
          f"flags {args.flag or 'default'}")
    for name, t in times.items():
        m, spread = median_spread(t)
        print(f"  {name:<18} {m:8.3f} s  ±{spread * 50:3.0f}%  {flops / m / 1e9:5.0f} GFLOP/s  "
              f"ratio (it / ours) {m / ours_s:5.2f}")
    if peer_times:
        print(f"  rel L2 of ours vs transformers f32: {error:.2e}")
    print(f"  matmul ceiling ({ceiling_name}) {ceiling:.0f} GFLOP/s; ours reaches {figures['ceiling_fraction']:.0%}")
    print(f"  emit {emit_s:.3f} s, compile {compile_s:.1f} s, vmfb {len(vmfb) / 1e6:.2f} MB, "
          f"weights {figures['weights_bytes'] / 1e9:.2f} GB, peak RSS {figures['peak_rss_bytes'] / 1e9:.2f} GB")
    if args.json:
        try:
            write_atomic(args.json, json.dumps(figures, indent=1) + "\n")
        except OSError as e:
            fail(str(e))
    return figures


if __name__ == "__main__":
    main()
