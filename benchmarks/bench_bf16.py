"""bf16 against f32 on this machine, for the host target and for AVX2 (x86-64-v3): one
vision block (bucket 256), one text decoder layer's 512-token prefill and decode step at
Qwen3-VL-2B widths, every form timed
alternating in one process (runtime/bench/bf16.py), then each form's resident memory after
load and one call, in a process of its own.

    .venv/bin/python benchmarks/bench_bf16.py [--rounds 9] [--json out.json]

Forms: f32, bf16 (bf16 x bf16 operands) and bf16-f32 (bf16 weights widened inside each
matmul) for the host; f32 and bf16-f32 for AVX2, with bf16 x bf16 on the decode step only
(IREE's scalar loop there: the control). Which form `qwen3vl` builds for bf16 is printed
per target (`emitter.precision.bf16_form`)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from emitter.precision import bf16_form, precision  # noqa: E402
from runtime.bench import bf16 as bf16_speed  # noqa: E402
from runtime.vision import set_thread_count  # noqa: E402

TARGETS = ("llvm-cpu", "llvm-cpu-x86-64-v3")
MEMORY = """
import os, sys
from runtime.bench import bf16 as bf16_speed
from runtime.artifact.iree_module import device_config
from runtime.vision import set_thread_count
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
set_thread_count(2)
graph, precision, target = sys.argv[1:4]
config = device_config(target)
before = resident()
call = {"vision": bf16_speed.vision_call, "decode": bf16_speed.decode_call}[graph](precision, target, config)
call()
print(resident() - before)
"""

def cpu() -> dict:
    """The CPU's model name and the flags that decide the bf16 form (from /proc/cpuinfo)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    fields = dict(line.split(":", 1) for line in info.splitlines()[:40] if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = fields.get("flags", "").split()
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
    return {"model": fields.get("model name", platform.processor()), "flags": [f for f in wanted if f in flags]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--json")
    args = p.parse_args(argv)
    set_thread_count(2)
    out = {"cpu": cpu(), "threads": 2, "targets": {}}
    graphs = ("vision", "prefill", "decode")
    for target in TARGETS:
        built = precision("bf16").for_target(target).name
        out["targets"][target] = {"bf16_built_as": built, "why": bf16_form(target)[1]}
        print(f"{target}: bf16 is built as {built} ({bf16_form(target)[1]})")
        if target == "llvm-cpu":  # every form, to show the choice
            times = bf16_speed.measure(target, ["f32", "bf16", "bf16-f32"], args.rounds, graphs)
        else:  # bf16 x bf16 is IREE's scalar loop here: only the decode step as the control
            times = bf16_speed.measure(target, ["f32", "bf16-f32"], args.rounds, graphs)
            times["decode"].update(bf16_speed.measure(target, ["bf16"], 2, graphs=("decode",))["decode"])
        out["targets"][target]["seconds"] = times
        for graph, t in times.items():
            for form, s in t.items():
                gbs = bf16_speed.weight_bytes(graph, form) / s / 1e9 if graph == "decode" else None
                print(f"{target:<20} {graph:<7} {form:<9} {s * 1e3:8.2f} ms  x{s / t['f32']:.2f} of f32"
                      + (f"  weights {gbs:5.1f} GB/s" if gbs else ""))
    rss = {}
    for graph in ("vision", "decode"):
        for form in ("f32", "bf16-f32", "bf16"):
            done = subprocess.run([sys.executable, "-c", MEMORY, graph, form, "llvm-cpu"], capture_output=True,
                                  text=True, check=True, cwd=Path(__file__).resolve().parent.parent)
            rss[f"{graph} {form}"] = int(done.stdout.split()[-1])
            print(f"resident after load and a call, {graph} {form} (host target): {rss[f'{graph} {form}'] / 1e6:.0f} "
                  f"MB (the host's weight arrays {bf16_speed.weight_bytes(graph, form) / 1e6:.0f} MB and IREE's "
                  f"packed copy)")
    out["resident_bytes"] = rss
    out["loadavg"] = os.getloadavg()
    print(f"cpu: {out['cpu']['model']}, flags {' '.join(out['cpu']['flags'])}; load average {out['loadavg'][0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
