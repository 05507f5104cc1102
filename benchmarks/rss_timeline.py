"""Where the peak RSS of one answer comes from: `qwen3vl generate`'s phases, one image.

A child process runs what `Generator.generate` runs, one phase at a time, and says when
each phase ends: the vision session loaded (its weights packed by IREE), the image
encoded, the vision session let go (as `generate` does for its one answer), the text
session loaded, the answer (prefill and decode), and with `--prefills N` N - 1 more
prefills of the same prompt (memory kept per call shows as growth from one to the next). At each phase's end it reads its own
/proc/self/status (RssAnon, RssFile), glibc's heap (mallinfo2: bytes in use and bytes freed
but kept) and the resident pages of each weight archive it maps. The parent samples the
child's /proc/PID/status every 20 ms, so each phase also gets its peak, and ends with the
child's ru_maxrss (os.wait4), the figure the llama.cpp bench compares.

    PYTHONPATH=. .venv/bin/python benchmarks/rss_timeline.py --model /tmp/b2 --precision int8 \\
        --image image.png --context 4096

A benchmark, not a test; nothing imports it. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

GB = 1e9
FIELDS = ("VmRSS", "RssAnon", "RssFile")


def status(pid="self") -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of a process in bytes (zeros once it is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return dict.fromkeys(FIELDS, 0)
    found = {k.strip(): v for k, _, v in (line.partition(":") for line in lines)}
    return {f: int(found.get(f, "0 kB").split()[0]) * 1024 for f in FIELDS}


def mapped_files() -> dict[str, int]:
    """Resident bytes of each file this process maps (smaps), the largest first."""
    rss, name = {}, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
            name = head[5] if len(head) > 5 else "[anon]"
        elif head and head[0] == "Rss:":
            rss[name] = rss.get(name, 0) + int(head[1]) * 1024
    return dict(sorted(((k, v) for k, v in rss.items() if v > 16 << 20), key=lambda kv: -kv[1]))


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                              "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap() -> dict[str, int]:
    """glibc's heap: bytes in use (main arena and mmapped chunks) and bytes freed but kept."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = MallInfo2
        info = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    return {"in_use": info.uordblks + info.hblkhd, "freed_kept": info.fordblks}


def child(options: dict) -> None:
    """Generate's phases, one by one, each end reported on stdout as `MARK {json}`: the
    `Generator` of `qwen3vl generate` (its methods wrapped to say when they end)."""
    import numpy as np

    from runtime.inputs.chat import Media, encode_joint
    from runtime.inputs.tokenizer import user_message
    from runtime.generator import Generator
    from runtime.text import run_tokens
    from runtime.sampling import Sampler

    def mark(phase: str) -> None:
        print("MARK " + json.dumps({"phase": phase, "t": time.time(), **status(), **heap(),
                                    "files": mapped_files()}), flush=True)

    def after(phase: str, fn):
        def wrapped(*args, **kwargs):
            result = fn(*args, **kwargs)
            mark(phase)
            return result
        return wrapped

    mark("start")
    letting_go = hasattr(Generator, "release_vision")  # an earlier tree (--tree) keeps its tower
    gen = Generator(options["model"], context=options["context"], precision=options["precision"],
                    threads=options["threads"], kv_cache_dtype=options["kv_cache_dtype"],
                    **({"keep_vision": options["keep_vision"]} if letting_go else {}))
    media = [Media("image", options["image"])]
    messages = user_message(options["prompt"], 1, 0)
    gen.check_prompt(messages, media, options["new"])
    mark("constructed")
    gen.vision.artifact()
    mark("vision loaded")
    if letting_go:
        gen.release_vision = after("vision let go", gen.release_vision)
    gen.text._load = after("text loaded", gen.text._load)
    gen.text.prefill = after("prefilled", gen.text.prefill)
    chat = gen.prepare(messages, media, options["new"],
                       encode=after("encoded", lambda items: encode_joint(lambda: gen.vision, items)))
    sampler = Sampler(gen.sampling, chat.ids, gen.text.cfg.vocab_size)
    tokens, _, _ = run_tokens(gen.text, chat, sampler, options["new"], gen.tokenizer.eos_ids)
    mark("decoded")
    for _ in range(options["prefills"] - 1):  # the same prompt again: what each later call keeps
        gen.text.prefill(chat.ids, chat.positions, chat.visual, chat.embeds, chat.deepstack)
    print("TOKENS " + json.dumps([int(t) for t in np.asarray(tokens)]), flush=True)


def run(options: dict, period: float = 0.02) -> dict:
    """The child, sampled: per phase its end state (the child's own report) and the peak of
    each status field since the previous phase; and the child's ru_maxrss."""
    env = dict(os.environ, PYTHONPATH=str(options["tree"]))
    proc = subprocess.Popen([sys.executable, __file__, "_child", json.dumps(options)], stdout=subprocess.PIPE,
                            text=True, env=env)
    marks, lock, peak = [], threading.Lock(), dict.fromkeys(FIELDS, 0)

    def read():
        for line in proc.stdout:
            if line.startswith("MARK "):
                with lock:
                    marks.append(dict(json.loads(line[5:]), peak=dict(peak)))
                    peak.update(dict.fromkeys(FIELDS, 0))
            elif line.startswith("TOKENS "):
                marks.append({"tokens": json.loads(line[7:])})

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while True:
        pid, code, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        now = status(proc.pid)
        with lock:
            for f in FIELDS:
                peak[f] = max(peak[f], now[f])
        time.sleep(period)
    proc.returncode = os.waitstatus_to_exitcode(code)
    reader.join()
    return {"marks": marks, "ru_maxrss": usage.ru_maxrss * 1024, "exit": proc.returncode}


def report(result: dict) -> str:
    lines = ["| phase ended | RSS | anon | file | peak RSS in the phase | heap in use | heap freed, kept | "
             "mapped files (resident) |", "|---|---|---|---|---|---|---|---|"]
    for m in result["marks"]:
        if "phase" not in m:
            continue
        files = ", ".join(f"{Path(k).name[:14]} {v / GB:.2f}" for k, v in list(m["files"].items())[:3])
        lines.append(f"| {m['phase']} | {m['VmRSS'] / GB:.2f} | {m['RssAnon'] / GB:.2f} | {m['RssFile'] / GB:.2f} "
                     f"| {m['peak']['VmRSS'] / GB:.2f} (anon {m['peak']['RssAnon'] / GB:.2f}) "
                     f"| {m.get('in_use', 0) / GB:.2f} | {m.get('freed_kept', 0) / GB:.2f} | {files} |")
    lines.append(f"\nru_maxrss of the child: {result['ru_maxrss'] / GB:.2f} GB")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        child(json.loads(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--image", required=True)
    p.add_argument("--precision", default="int8")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--kv-cache-dtype", default="f32")
    p.add_argument("--prompt", default="Describe the image.")
    p.add_argument("--new", type=int, default=16, help="new tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefills", type=int, default=1,
                   help="prefill the prompt this many times in all (the later ones after the answer), each "
                        "call a phase: memory a serving process keeps per call")
    p.add_argument("--keep-vision", action="store_true",
                   help="keep the vision session beside the language model (generate lets it go)")
    p.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent),
                   help="the source tree the child imports (default: this one; e.g. an earlier checkout)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    options = {k: v for k, v in vars(args).items() if k != "json"}
    result = run(options)
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
