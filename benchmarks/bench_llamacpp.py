"""Side by side with llama.cpp on this CPU: the same random Qwen3-VL checkpoint, both sides
timed alternately in one sitting, on the same thread count.

What it does (every step reused on a rerun; nothing of llama.cpp lands in the repository):
1. llama.cpp from a registry package's source: `pip download --no-binary :all: --no-deps
   llama-cpp-python==VERSION` (the sdist vendors ggml-org/llama.cpp with its converter and
   tools/mtmd), extracted into --work-dir (default ~/.cache/qwen3vl-iree/llamacpp) and built
   with cmake (Release, -DGGML_NATIVE=ON, CPU only): llama-bench, llama-mtmd-cli,
   llama-quantize.
2. One random checkpoint (`qwen3vl random-checkpoint --preset P --with-text`), converted with
   llama.cpp's own convert_hf_to_gguf.py (run with this venv's python; gguf-py comes from the
   sdist): text f32, bf16, q8_0, and Q4_0 and Q4_K_M by llama-quantize from f32; projector
   (--mmproj) f32 and f16. The random tokenizer's pre-tokenizer hash is unknown to the
   converter: the extracted copy is patched to map an unknown hash to `qwen2` (said in
   the output).
3. Rounds, the side that goes first alternating between rounds, per precision pair
   (ours f32 / llama.cpp f32, ours bf16 / llama.cpp bf16 text + f16 projector; at equal
   bits, text only (PAIRS): ours int8 (groups of 64) / Q8_0, ours q8_0 (Q8_0 weights and
   activations through the hand-written kernel, row "q8_0-kernel") / Q8_0, ours int4 / Q4_0 and Q4_K_M,
   ours q4_0 (Q4_0 weights, Q8_0 activations, the same kernel, row "q4_0-kernel") / Q4_0;
   the answer's projector is then llama.cpp's f16 one and ours the f32 tower):
   - vision per image (256x256, 512x512, 1024x1024 noise PNGs): llama-mtmd-cli's encode time
     ("slice encoded in" / "batch encoding done in", preprocessing excluded; the text model
     loaded beside it is the Q4_K_M one) against one `VisionSession` call on the same image
     (`out.seconds["run"]`: packing and the call, preprocessing excluded; bucket = the
     image's patches), after a warm-up call; one image per process on both sides;
   - prefill tokens/s at 512 tokens and decode ms/token over 64 tokens after them: `llama-bench
     -p 512 -n 64 -d 0,512 -r 1` (prefill at depth 0, decode at depth 512) against a
     `TextSession` (bucket 512, context 576) in a child process (prefill of 512 random ids,
     then 64 greedy decode steps, after a warm-up): both decode over the same 512-576 cached
     tokens; our KV cache in --kv-cache-dtype, llama-bench's in its default f16 (equal bits:
     --kv-cache-dtype bf16);
   - one answer, one 256x256 image + a short prompt, 16 new tokens, context 4096:
     `llama-mtmd-cli -c 4096 -n 16 --ignore-eos` against `qwen3vl generate --context 4096
     --max-new-tokens 16`: time to first token (llama.cpp: encode + prompt eval; ours:
     vision incl. preprocessing + prefill, from --json), decode ms/token at context 4096,
     and the peak RSS of the process (os.wait4's ru_maxrss).
   llama.cpp runs in its default configuration (weights repacked for this CPU), except on a
   CPU that advertises amx: there its quantized rows run with --no-repack (NO_REPACK_NOTE:
   its AMX path died on such a VM). A process that fails (e.g. killed for memory) is recorded as
   an error and the round goes on.
   Before the rounds each of our child processes runs once untimed, so every IREE module is
   compiled into the artifact cache outside the clock (and iree-compile's memory is not in
   a measured RSS).
4. Prints a table of medians (the best round in brackets where there are several), with
   `lscpu`'s model name and flags, the load average before and after, and writes --json (and
   --chart, by default beside it: the "ours better by" column as an SVG bar chart).

    .venv/bin/python benchmarks/bench_llamacpp.py --json llamacpp.json          # 2B, 2 rounds
    .venv/bin/python benchmarks/bench_llamacpp.py --preset tiny --rounds 1      # a quick check
    .venv/bin/python benchmarks/bench_llamacpp.py --rows q8_0 q4_0 --tasks answer --kv-cache-dtype bf16
        # the answer rows alone (peak RSS), our KV cache in 16 bits as llama.cpp's (f16 by default)

Figures are ratios from one sitting; llama.cpp's threads synchronise after every op, so a
busy machine hurts it more than us: quote the load average with them. This is a
benchmark, not a test; nothing imports it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runtime.bench.llamacpp import VERSION, convert, fetch_source, patch_converter, run_logged  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
QWEN3VL = str(Path(PYTHON).with_name("qwen3vl"))
TOOLS = ("llama-bench", "llama-mtmd-cli", "llama-quantize")
IMAGE_SIZES = (256, 512, 1024)
PROMPT = "Describe the image."
PREFILL, DECODE, ANSWER_TOKENS, ANSWER_CONTEXT = 512, 64, 16, 4096
TASKS = ("vision", "text", "answer")
QUALITY_TOKENS = 64
QUANTIZED = ("q8_0", "q8_0-kernel", "q4_0", "q4_0-kernel", "q4_k_m")  # rows of quantized weights: text only (the projector is the f16 one)
NO_REPACK_NOTE = ("llama.cpp's quantized text models run with --no-repack (llama-bench --repack 0): with repacking "
                  "on, a VM with amx flags in /proc/cpuinfo died in the AMX buffer type (Q8_0: SIGILL, Q4_K_M: "
                  "SIGSEGV at warm-up); f32/bf16 text is not repacked either way")
REPACK_NOTE = "llama.cpp in its default configuration: quantized weights repacked for this CPU"


@functools.cache
def llama_repacks() -> bool:
    """Whether llama.cpp's quantized rows repack their weights (its default): not on a CPU
    that advertises amx (NO_REPACK_NOTE)."""
    return "amx" not in Path("/proc/cpuinfo").read_text()
# (row, ours' precision or None, llama.cpp text GGUF, llama.cpp projector GGUF)
PAIRS = (("f32", "f32", "text-f32", "mmproj-f32"), ("bf16", "bf16", "text-bf16", "mmproj-f16"),
         ("q8_0", "int8", "text-q8_0", "mmproj-f16"), ("q8_0-kernel", "q8_0", "text-q8_0", "mmproj-f16"),
         ("q4_0", "int4", "text-q4_0", "mmproj-f16"), ("q4_0-kernel", "q4_0", "text-q4_0", "mmproj-f16"),
         ("q4_k_m", "int4", "text-q4_k_m", "mmproj-f16"))


def llama_type(text: str) -> str:
    """llama.cpp's name of a row's text GGUF type ("text-q8_0" -> "Q8_0")."""
    return text.removeprefix("text-").upper()


LLAMA_QUANTIZE = {"text-q4_0": "Q4_0", "text-q4_k_m": "Q4_K_M"}  # written by llama-quantize from text-f32


# --isa -> (llama.cpp's cmake options, our compile target). "avx2": both sides without AVX-512
# on any x86-64 host with AVX2 and FMA (Haswell, Zen 1-3), as an AVX2-only machine runs them.
ISAS = {"native": (("-DGGML_NATIVE=ON",), "llvm-cpu"),
        "avx2": (("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                  "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF"), "llvm-cpu-x86-64-v3")}


# --- llama.cpp from the sdist -------------------------------------------------------------

def build_tools(src: Path, build: Path, jobs: int, isa: str = "native") -> Path:
    """llama.cpp's CPU tools (TOOLS), built once with cmake (Release, ISAS[isa]'s options);
    returns the folder holding them."""
    bindir = build / "bin"
    if all((bindir / t).exists() for t in TOOLS):
        return bindir
    log = build.parent / "build.log"
    run_logged(["cmake", "-S", src, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", *ISAS[isa][0],
                "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF",
                "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                "-DLLAMA_BUILD_APP=OFF"], log)
    run_logged(["cmake", "--build", build, "-j", str(jobs), "--target", *TOOLS], log)
    return bindir


def build_logits_tool(src: Path, bindir: Path, log: Path) -> Path:
    """benchmarks/llamacpp_logits.c compiled against the libllama beside the tools (once)."""
    exe = bindir / "llamacpp-logits"
    if not exe.exists():
        libs = {p.parent for p in bindir.parent.rglob("lib*.so")}  # libllama's and libggml's folders
        run_logged(["cc", "-O2", ROOT / "benchmarks" / "llamacpp_logits.c", "-I", src / "include",
                    "-I", src / "ggml" / "include", *[f"-L{d}" for d in libs], "-lllama",
                    *[f"-Wl,-rpath,{d}" for d in libs], "-o", exe], log)
    return exe


# --- the checkpoint and its GGUF forms ------------------------------------------------------

def model_name(preset: str, layers: int | None) -> str:
    """The checkpoint's (and its GGUF folder's) name: the preset, and its layer count if cut."""
    return f"{preset}-{layers}l" if layers else preset


def write_checkpoint(work: Path, preset: str, layers: int | None = None) -> Path:
    """The random checkpoint both sides read (written once per preset and layer count:
    `random-checkpoint --layers`, the preset's widths at fewer layers)."""
    folder = work / "models" / f"{model_name(preset, layers)}-hf"
    if not (folder / "config.json").exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        run_logged([QWEN3VL, "random-checkpoint", folder, "--preset", preset, "--with-text",
                    *(["--layers", str(layers)] if layers else [])], work / "convert.log")
    return folder


CONVERTED = {"text-f32": ["--outtype", "f32"], "text-bf16": ["--outtype", "bf16"], "text-q8_0": ["--outtype", "q8_0"],
             "mmproj-f32": ["--mmproj", "--outtype", "f32"], "mmproj-f16": ["--mmproj", "--outtype", "f16"]}


def needed_files(rows, tasks) -> set[str]:
    """The GGUF files the rows' `tasks` read (the vision task's text file is Q4_K_M's)."""
    names = {text for _, _, text, _ in rows if "text" in tasks or "answer" in tasks}
    names |= {mmproj for _, _, _, mmproj in rows if "answer" in tasks or "vision" in tasks}
    return names | ({"text-q4_k_m", "mmproj-f16"} if "vision" in tasks else set())


def convert_all(src: Path, bindir: Path, ckpt: Path, out: Path, log: Path, names=None) -> dict[str, Path]:
    """The GGUF files the rounds use (`names`, default every one), by name (see PAIRS); each
    written once. llama-quantize's types come from the f32 file, or from the bf16 one where
    the f32 file is not itself needed (a large checkpoint: half the disk)."""
    names = set(CONVERTED) | set(LLAMA_QUANTIZE) if names is None else set(names)
    source = "text-f32" if "text-f32" in names else "text-bf16"
    if any(not (out / f"{name}.gguf").exists() for name in names & set(LLAMA_QUANTIZE)):
        names.add(source)  # (kept or removed after, as the disk allows: not needed again)
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, args in CONVERTED.items():
        if name in names:
            files[name] = convert(src, ckpt, out / f"{name}.gguf", args, log)
    for name, kind in LLAMA_QUANTIZE.items():
        if name not in names:
            continue
        files[name] = out / f"{name}.gguf"
        if not files[name].exists():
            tmp = out / f"{name}.tmp.gguf"
            run_logged([bindir / "llama-quantize", files[source], tmp, kind, "2"], log)
            tmp.rename(files[name])
    return files


def write_images(folder: Path, sizes=IMAGE_SIZES) -> dict[int, Path]:
    """Square RGB noise PNGs (seeded), one per size."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    images = {}
    for size in sizes:
        images[size] = folder / f"noise-{size}.png"
        if not images[size].exists():
            pixels = np.random.default_rng(size).integers(0, 256, (size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(images[size])
    return images


# --- one timed process ---------------------------------------------------------------------

def timed_process(cmd, env=None) -> tuple[str, float, int]:
    """Run `cmd` to the end: (its stdout and stderr, wall seconds, peak RSS in bytes of the
    process, from os.wait4). A failure raises with the output's tail."""
    start = time.perf_counter()
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env, text=True, errors="replace")
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{Path(str(cmd[0])).name} exited {proc.returncode}:\n{output[-3000:]}")
    return output, seconds, usage.ru_maxrss * 1024


def find_float(pattern: str, text: str, group: int = 1) -> float | None:
    """The last match's `group` of `pattern` in `text` as a float, or None."""
    matches = list(re.finditer(pattern, text))
    return float(matches[-1].group(group)) if matches else None


# --- llama.cpp's side ----------------------------------------------------------------------

def llama_mtmd(bindir: Path, text: Path, mmproj: Path, image: Path, threads: int, n_predict: int,
               repack: bool = True, context: int = ANSWER_CONTEXT) -> dict:
    """One llama-mtmd-cli run (greedy, EOS ignored): image encode ms, prompt eval ms and
    tokens (the image's and the text's), decode ms per token, peak RSS. `repack=False`:
    --no-repack (no AMX or other repacked weight buffers, see NO_REPACK_NOTE)."""
    out, wall, rss = timed_process([bindir / "llama-mtmd-cli", "-m", text, "--mmproj", mmproj, "--image", image,
                                    "-p", PROMPT, "-n", n_predict, "-t", threads, "--temp", "0", "-c", context,
                                    "--ignore-eos", "--perf", "-lv", 4, *([] if repack else ["--no-repack"])])
    encode = find_float(r"slice encoded in (\d+) ms", out) or find_float(r"batch encoding done in (\d+) ms", out)
    prompt_ms = find_float(r"prompt eval time =\s*([\d.]+) ms", out)
    prompt_tokens = find_float(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens", out)
    eval_ms = find_float(r"\beval time =\s*([\d.]+) ms /\s*\d+ runs", out)
    runs = find_float(r"\beval time =\s*[\d.]+ ms /\s*(\d+) runs", out)
    if encode is None or prompt_ms is None:
        raise RuntimeError(f"llama-mtmd-cli: no encode or prompt-eval time in its output:\n{out[-3000:]}")
    return {"encode_s": encode / 1e3, "ttft_s": (encode + prompt_ms) / 1e3, "prompt_tokens": prompt_tokens,
            "decode_ms_token": eval_ms / runs if runs else None, "decode_steps": runs, "peak_rss_gb": rss / 1e9,
            "wall_s": wall}


def llama_bench(bindir: Path, gguf: Path, threads: int, repack: bool = True) -> dict:
    """One llama-bench run (-p PREFILL -n DECODE -d 0,PREFILL -r 1): prefill tokens/s (at depth 0),
    decode ms/token at depth PREFILL (over the cached tokens our decode steps see, after their
    prefill), and the model's size, parameters and bits per weight as llama-bench reports them."""
    out, _, _ = timed_process([bindir / "llama-bench", "-m", gguf, "-t", threads, "-p", PREFILL, "-n", DECODE,
                               "-d", f"0,{PREFILL}", "-r", 1, "-o", "json", *([] if repack else ["--repack", 0])])
    rows = json.loads(out[out.index("["):out.rindex("]") + 1])
    prefill = next(r for r in rows if r["n_prompt"] == PREFILL and r["n_gen"] == 0 and r.get("n_depth", 0) == 0)
    decode = next(r for r in rows if r["n_gen"] == DECODE and r["n_prompt"] == 0 and r.get("n_depth") == PREFILL)
    return {"prefill_tok_s": prefill["avg_ts"], "decode_ms_token": 1e3 / decode["avg_ts"],
            "model_gb": prefill["model_size"] / 1e9, "params": prefill["model_n_params"],
            "bits_per_weight": prefill["model_size"] * 8 / prefill["model_n_params"]}


# --- our side: child processes of this script -----------------------------------------------

def child(kind: str, options: dict) -> dict:
    """Run `kind` ("vision" or "text") of this script in a child process; its result."""
    out, wall, rss = timed_process([PYTHON, __file__, "_child", kind, json.dumps(options)],
                                   env=dict(os.environ, PYTHONPATH=str(ROOT)))
    line = next(l for l in reversed(out.splitlines()) if l.startswith("RESULT "))
    return dict(json.loads(line[len("RESULT "):]), wall_s=wall, peak_rss_gb=rss / 1e9)


def child_vision(options: dict) -> dict:
    """In the child: one VisionSession whose one bucket is the image's patch count, a
    warm-up call, then one timed call: seconds of out.seconds["run"], the grid, and the
    form bf16 was built as. One image per process, as llama-mtmd-cli runs it."""
    from emitter.precision import bf16_form
    from runtime.vision import VisionSession, set_thread_count

    set_thread_count(options["threads"])
    size, path = options["image"]
    session = VisionSession(options["model"], buckets=((size // 16) ** 2,), precision=options["precision"],
                            target=options["target"])
    session.artifact()
    session.encode([path])  # warm-up
    out = session.encode([path])
    return {"seconds": out.seconds["run"], "grid": out.grid_thw[0].tolist(), "built_as": session.plan.precision,
            "bf16_form": bf16_form(options["target"])}


def child_text(options: dict) -> dict:
    """In the child: one TextSession (bucket PREFILL, context PREFILL + DECODE), a warm-up,
    then prefill of PREFILL random ids and DECODE - 1 greedy decode steps."""
    import numpy as np

    from runtime.sizing import step_bytes
    from runtime.text import TextSession
    from runtime.vision import set_thread_count

    set_thread_count(options["threads"])
    session = TextSession(options["model"], buckets=(PREFILL,), context=PREFILL + DECODE,
                          precision=options["precision"], target=options["target"],
                          kv_cache_dtype=options.get("kv", "f32"))
    session.module
    ids = np.random.default_rng(0).integers(0, session.cfg.vocab_size, PREFILL)
    positions = np.broadcast_to(np.arange(PREFILL), (3, PREFILL))
    session.prefill(ids, positions)  # warm-up
    session.decode(1, session.length)
    start = time.perf_counter()
    logits = session.prefill(ids, positions)
    prefill = time.perf_counter() - start
    token = int(np.argmax(logits))
    start = time.perf_counter()
    for _ in range(DECODE - 1):
        token = int(np.argmax(session.decode(token, session.length)))
    decode = (time.perf_counter() - start) / (DECODE - 1)
    step = step_bytes(session.cfg, session.precision)
    return {"prefill_tok_s": PREFILL / prefill, "decode_ms_token": decode * 1e3, "built_as": str(session.precision),
            "archive_bytes": Path(session.archive_path).stat().st_size, "step_weight_gb": step / 1e9,
            "decode_weight_gbs": step / decode / 1e9}


def ours_answer(model: Path, image: Path, precision: str, threads: int, target: str, tmp: Path,
                kv: str = "f32") -> dict:
    """`qwen3vl generate` in a child process (one image, PROMPT, ANSWER_TOKENS new tokens,
    context ANSWER_CONTEXT, KV cache in `kv`): time to first token (vision + prefill of its
    --json), decode ms/token, peak RSS."""
    report = tmp / f"answer-{precision}.json"
    _, wall, rss = timed_process([QWEN3VL, "generate", "--model", model, "--image", image, "--prompt", PROMPT,
                                  "--max-new-tokens", ANSWER_TOKENS, "--context", ANSWER_CONTEXT,
                                  "--precision", precision, "--threads", threads, "--target", target,
                                  "--kv-cache-dtype", kv, "--json", report])
    data = json.loads(report.read_text())
    seconds, steps = data["seconds"], len(data["tokens"]) - 1
    return {"ttft_s": seconds["vision"] + seconds["prefill"], "prompt_tokens": data["prompt_tokens"],
            "decode_ms_token": seconds["decode"] / steps * 1e3 if steps else None, "decode_steps": steps,
            "peak_rss_gb": rss / 1e9, "wall_s": wall}


# --- logit quality at equal bits -----------------------------------------------------------

def child_logits(options: dict) -> dict:
    """In the child: teacher-forced logits of QUALITY_TOKENS ids (options["ids"] file) through
    our TextSession: a prefill of the first id, then one decode step per id; written to
    options["out"] as float32 [ids, vocab], as llamacpp_logits.c writes llama.cpp's."""
    import numpy as np

    from runtime.text import TextSession
    from runtime.vision import set_thread_count

    set_thread_count(options["threads"])
    ids = np.fromfile(options["ids"], dtype=np.int32)
    session = TextSession(options["model"], buckets=(16,), context=len(ids) + 16, precision=options["precision"],
                          target=options["target"])
    rows = [session.prefill(ids[:1], np.zeros((3, 1), np.int64))]
    rows += [session.decode(int(t), session.length) for t in ids[1:]]
    np.stack([np.asarray(r, np.float32).reshape(-1) for r in rows]).tofile(options["out"])
    return {"built_as": session.precision}


def quality(model: Path, files: dict, rows, logits_tool: Path, threads: int, target: str, tmp: Path) -> dict:
    """Each side's distance from its own f32 model, at each row's bits: the relative L2 of
    the teacher-forced logits over QUALITY_TOKENS random ids, and the share of positions
    whose argmax equals the f32 model's. Plus ours f32 against llama.cpp f32 (the two sides
    computing the same model)."""
    import numpy as np

    from emitter.text_config import load_text_config

    cfg, _ = load_text_config(model)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, QUALITY_TOKENS).astype(np.int32)
    ids_file = tmp / "quality-ids.i32"
    ids.tofile(ids_file)

    @functools.cache
    def ours(precision):
        out = tmp / f"logits-ours-{precision}.f32"
        child("logits", {"model": str(model), "precision": precision, "threads": threads, "target": target,
                         "ids": str(ids_file), "out": str(out)})
        return np.fromfile(out, np.float32).reshape(len(ids), -1)

    @functools.cache
    def llama(text):
        out = tmp / f"logits-llama-{text}.f32"
        timed_process([logits_tool, files[text], ids_file, out, threads, int(llama_repacks())])
        return np.fromfile(out, np.float32).reshape(len(ids), -1)

    def distance(logits, reference):
        """{"rel_l2", "argmax_agree"} of two sides' logits, or the error of the one that failed."""
        try:
            x, ref = logits(), reference()
        except RuntimeError as e:
            print(f"  failed: {str(e)[:300]}", flush=True)
            return {"error": str(e)[-2000:]}
        return {"rel_l2": float(np.linalg.norm(x - ref) / np.linalg.norm(ref)),
                "argmax_agree": float(np.mean(x.argmax(-1) == ref.argmax(-1)))}

    result = {"tokens": len(ids),
              "ours_f32_vs_llama_f32": distance(lambda: ours("f32"), lambda: llama("text-f32"))}
    for name, precision, text, _ in rows:
        if name in QUANTIZED:
            result[name] = {"ours": distance(lambda: ours(precision), lambda: ours("f32")),
                            "llama": distance(lambda: llama(text), lambda: llama("text-f32")),
                            "ours_precision": precision, "llama_type": llama_type(text)}
            print(f"  {name} quality: {result[name]}", flush=True)
    return result


def quality_table(q: dict) -> str:
    """Markdown: per row, each side's relL2 from its own f32 logits and argmax agreement."""
    def fmt(d):
        return "failed (see --json)" if "error" in d else f"{d['rel_l2']:.3g} / {d['argmax_agree']:.2f}"

    lines = [f"logit distance from each side's own f32 model ({q['tokens']} teacher-forced random ids)",
             "| row | ours: relL2 / argmax agree | llama.cpp: relL2 / argmax agree |", "|---|---|---|"]
    for name, row in q.items():
        if isinstance(row, dict) and "ours" in row:
            lines.append(f"| {row['ours_precision']} / {row['llama_type']} | {fmt(row['ours'])} | {fmt(row['llama'])} |")
    lines.append(f"ours f32 against llama.cpp f32: {fmt(q['ours_f32_vs_llama_f32'])}")
    return "\n".join(lines)


# --- the sitting ---------------------------------------------------------------------------

def machine() -> dict:
    """lscpu's model name and flags, the core count, and the load average now."""
    info = dict(line.split(":", 1) for line in subprocess.run(["lscpu"], capture_output=True, text=True)
                .stdout.splitlines() if ":" in line)
    return {"cpu": info.get("Model name", "").strip(), "flags": info.get("Flags", "").split(),
            "cores": os.cpu_count(), "load_average": os.getloadavg()}


def warm_ours(model: Path, images: dict, precisions, threads: int, target: str, tmp: Path,
              sizes=IMAGE_SIZES, tasks=TASKS, kv: str = "f32") -> dict:
    """Each of our child runs of `tasks` once, untimed: every module compiled (or found) in
    the cache. Returns each run's result (or error), by step."""
    seconds = {}
    for precision in precisions:
        options = {"model": str(model), "precision": precision, "threads": threads, "target": target, "kv": kv}
        for size, path in ((s, p) for s, p in images.items() if s in sizes and precision in ("f32", "bf16")
                           and "vision" in tasks):
            image = dict(options, image=[size, str(path)])
            seconds[f"vision-{size}-{precision}"] = attempt(lambda: child("vision", image))
        if "text" in tasks:
            seconds[f"text-{precision}"] = attempt(lambda: child("text", options))
        small = images[min(images)]
        if "answer" in tasks:
            seconds[f"answer-{precision}"] = attempt(lambda: ours_answer(model, small, precision, threads, target,
                                                                         tmp, kv))
        print(f"  ours {precision}: compiled or found in the cache ({seconds})", flush=True)
    return seconds


def attempt(run) -> dict:
    """`run()`, or {"error": ...} when its process failed (e.g. killed for memory)."""
    try:
        return run()
    except RuntimeError as e:
        print(f"  failed: {str(e)[:300]}", flush=True)
        return {"error": str(e)[-2000:]}


def one_round(first: str, row, model: Path, images: dict, files: dict, bindir: Path, threads: int,
              target: str, tmp: Path, sizes=IMAGE_SIZES, tasks=TASKS, kv: str = "f32") -> dict:
    """One round of one precision row: vision, text, answer (those of `tasks`), each side in
    turn (`first` goes first); our text and answer KV cache in `kv`. Ours is skipped when the row
    has no precision of ours, and for images not in `sizes` (recorded as an error saying so)."""
    name, precision, text, mmproj = row
    options = {"model": str(model), "precision": precision, "threads": threads, "target": target, "kv": kv}
    small = images[min(images)]
    repack = name not in QUANTIZED or llama_repacks()
    sides = {f"vision_{s}": {
        "ours": lambda s=s, p=p: (child("vision", dict(options, image=[s, str(p)])) if s in sizes
                                  else {"error": f"{s}x{s} not run on our side (--ours-vision-sizes)"}),
        "llama": lambda p=p: llama_mtmd(bindir, files["text-q4_k_m"], files[mmproj], p, threads, 1,
                                        repack=llama_repacks())}
        for s, p in images.items()}
    sides.update({
        "text": {"ours": lambda: child("text", options),
                 "llama": lambda: llama_bench(bindir, files[text], threads, repack=repack)},
        "answer": {"ours": lambda: ours_answer(model, small, precision, threads, target, tmp, kv),
                   "llama": lambda: llama_mtmd(bindir, files[text], files[mmproj], small, threads, ANSWER_TOKENS,
                                               repack=repack)},
    })
    order = ("ours", "llama") if first == "ours" else ("llama", "ours")
    result = {}
    for task, runs in sides.items():
        if name in QUANTIZED and task.startswith("vision") or task.split("_")[0] not in tasks:
            continue  # the quantized rows' projector is the bf16 row's f16 one
        for side in order:
            result.setdefault(task, {})[side] = attempt(runs[side])
            print(f"  {name} {task} {side}: done", flush=True)
    return result


def median_best(values, higher_is_better: bool = False) -> dict | None:
    """Median and best (min, or max for a rate) of the rounds' values; None if none."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    best = max(values) if higher_is_better else min(values)
    return {"median": statistics.median(values), "best": best, "n": len(values)}


def summarize(rounds: list[dict]) -> dict:
    """Per row and figure, ours and llama.cpp's median and best over the rounds."""
    figures = {
        "vision_s": lambda r, side, size: (r[f"vision_{size}"][side]["seconds"] if side == "ours"
                                           else r[f"vision_{size}"][side]["encode_s"]),
        "prefill_tok_s": lambda r, side, _: r["text"][side]["prefill_tok_s"],
        "decode_ms_token": lambda r, side, _: r["text"][side]["decode_ms_token"],
        "ttft_s": lambda r, side, _: r["answer"][side]["ttft_s"],
        "decode_ms_token_ctx4096": lambda r, side, _: r["answer"][side]["decode_ms_token"],
        "peak_rss_gb": lambda r, side, _: r["answer"][side]["peak_rss_gb"],
    }
    out = {}
    for name, *_ in PAIRS:
        runs = [r[name] for r in rounds if name in r]
        if not runs:
            continue
        row = {}
        for figure, get in figures.items():
            for size in ([str(s) for s in IMAGE_SIZES] if figure == "vision_s" else [None]):
                key = f"{figure}_{size}" if size else figure
                for side in ("ours", "llama"):
                    try:
                        row.setdefault(key, {})[side] = median_best([get(r, side, size) for r in runs],
                                                                    figure == "prefill_tok_s")
                    except (KeyError, TypeError):
                        row.setdefault(key, {})[side] = None
        out[name] = row
    return out


def weight_traffic(rounds: list[dict], bandwidth: dict) -> str:
    """Per row, the weight bytes our decode step reads (a sparse layer's chosen experts only:
    runtime/sizing.py `step_bytes`) over its median time, against the machine's read roof."""
    lines = [f"decode weight traffic (read roof {bandwidth['read_gbs']:.1f} GB/s, triad {bandwidth['triad_gbs']:.1f}):"]
    for name, *_ in PAIRS:
        runs = [r[name]["text"]["ours"] for r in rounds if name in r and "decode_weight_gbs" in r[name]["text"]["ours"]]
        if runs:
            gbs = statistics.median(r["decode_weight_gbs"] for r in runs)
            lines.append(f"  {name}: {runs[0]['step_weight_gb']:.3f} GB of weights a step, {gbs:.1f} GB/s "
                         f"= {gbs / bandwidth['read_gbs']:.0%} of the read roof")
    return "\n".join(lines)


def better_by(figure: str, ours: float, llama: float) -> float:
    """N > 1 when ours is better (faster, or less memory)."""
    return ours / llama if figure == "prefill_tok_s" else llama / ours


def ratio(figure: str, ours: float, llama: float) -> str:
    return f"x{better_by(figure, ours, llama):.2f}"


def write_ratio_chart(report: dict, path: Path) -> str:
    """The table's "ours better by" column as an SVG bar chart (runtime/bench/chart.py): one bar
    per row and figure, the ratio of the medians."""
    from runtime.bench.chart import Bar, write_chart

    bars = [Bar(f"{name}: {key}", better_by(key, sides["ours"]["median"], sides["llama"]["median"]))
            for name, row in report["summary"].items() for key, sides in row.items() if sides["llama"] and sides["ours"]]
    if not bars:
        return "chart: not written (no figure of both sides)"
    m = report["machine_before"]
    layers = f", {report['layers']} layers" if report["layers"] else ""
    note = (f"{report['preset']}{layers}, {report['threads']} threads, {m['cpu']}, load {m['load_average'][0]:.1f}, "
            f"{report['date']}; medians of {len(report['rounds'])} rounds")
    write_chart(path, bars, "Ours against llama.cpp: better by (medians)", note)
    return f"chart: {path}"


def table(summary: dict, bits: dict) -> str:
    """Markdown: one line per row and figure, medians (best), and ours' advantage."""
    lines = ["| bits (ours / llama.cpp) | figure | ours | llama.cpp | ours better by |", "|---|---|---|---|---|"]
    for name, row in summary.items():
        for key, sides in row.items():
            if sides["llama"] is None:
                continue
            llama, ours = sides["llama"], sides["ours"]
            fmt = lambda v: f"{v['median']:.3g}" + (f" ({v['best']:.3g})" if v["n"] > 1 else "")  # noqa: E731
            ours_text = fmt(ours) if ours else "failed or not run (see --json)"
            better = ratio(key, ours["median"], llama["median"]) if ours else "-"
            lines.append(f"| {bits[name]} | {key} | {ours_text} | {fmt(llama)} | {better} |")
    return "\n".join(lines)


def bits_labels(rounds: list[dict]) -> dict:
    """Row name -> "ours: precision (bits per weight) / llama.cpp: type (bits per weight)",
    both over llama-bench's parameter count of the text model: ours from the size of the
    text archive our child opened, llama.cpp's as llama-bench reports it."""
    form = next((v["ours"]["built_as"] for r in rounds for k, v in r.get("bf16", {}).items()
                 if k.startswith("vision") and "built_as" in v.get("ours", {})), "?")
    labels = {}
    for name, precision, gguf, _ in PAIRS:
        text = next((r[name]["text"] for r in rounds if name in r and "text" in r[name]), {})
        llama, ours = text.get("llama", {}), text.get("ours", {})
        lbpw = f"{llama['bits_per_weight']:.2f} bpw" if "bits_per_weight" in llama else "?"
        obpw = (f"{ours['archive_bytes'] * 8 / llama['params']:.2f} bpw"
                if "archive_bytes" in ours and "params" in llama else "?")
        built = (f", built as {form}" if precision == "bf16" else
                 f", built as {ours['built_as']}" if ours.get("built_as", precision) != precision else "")
        labels[name] = f"{precision} ({obpw}{built}) / {llama_type(gguf)} ({lbpw})"
    return labels


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        result = {"vision": child_vision, "text": child_text, "logits": child_logits}[sys.argv[2]](json.loads(sys.argv[3]))
        print("RESULT " + json.dumps(result), flush=True)
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-vl-2b")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="the preset's widths at N language-model layers (random-checkpoint --layers): a large "
                        "model's stand-in where disk or memory do not hold it whole")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--isa", choices=list(ISAS), default="native",
                   help="native: each side's code for this CPU; avx2: both without AVX-512 (llama.cpp built "
                        "with AVX2/FMA only, ours compiled for x86-64-v3)")
    p.add_argument("--rows", nargs="+", default=[r[0] for r in PAIRS], choices=[r[0] for r in PAIRS])
    p.add_argument("--work-dir", type=Path, default=Path.home() / ".cache" / "qwen3vl-iree" / "llamacpp")
    p.add_argument("--version", default=VERSION, help="llama-cpp-python sdist version")
    p.add_argument("--jobs", type=int, default=os.cpu_count(), help="build jobs")
    p.add_argument("--json", type=Path, metavar="FILE")
    p.add_argument("--chart", type=Path, metavar="FILE.svg",
                   help="the ratios as an SVG bar chart (default with --json: beside it, .svg)")
    p.add_argument("--ours-vision-sizes", type=int, nargs="+", default=list(IMAGE_SIZES),
                   help="images our side encodes (e.g. leave out one that does not fit in memory)")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS),
                   help="figures to measure: vision per image, text (prefill and decode), answer (time to first "
                        "token, decode at context 4096, peak RSS)")
    p.add_argument("--kv-cache-dtype", choices=("f32", "bf16"), default="f32",
                   help="our KV cache in the text and answer tasks (llama.cpp's default is f16)")
    p.add_argument("--quality", action="store_true",
                   help="also each side's logit distance from its own f32 model at each row's bits")
    p.add_argument("--skip-warm", action="store_true",
                   help="skip the untimed run of our children (only when every module is already in the cache)")
    args = p.parse_args()

    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    src = fetch_source(work, args.version)
    patched = patch_converter(src)
    print(patched, flush=True)
    suffix = "" if args.isa == "native" else f"-{args.isa}"
    bindir = build_tools(src, work / f"build-{args.version}{suffix}", args.jobs, args.isa)
    target = ISAS[args.isa][1]
    print(f"llama.cpp tools: {bindir}", flush=True)
    model = write_checkpoint(work, args.preset, args.layers)
    name = model_name(args.preset, args.layers)
    rows = [r for r in PAIRS if r[0] in args.rows]
    files = convert_all(src, bindir, model, work / "gguf" / name, work / "convert.log",
                        None if args.quality else needed_files(rows, args.tasks))
    images = write_images(work / "images")
    prepared = time.perf_counter() - start
    tmp = work / "runs" / name  # per model: the quality step's logits files are named by precision only
    tmp.mkdir(parents=True, exist_ok=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv),
              "preset": args.preset, "layers": args.layers, "threads": args.threads, "isa": args.isa, "target": target, "llama_cpp": f"llama-cpp-python {args.version} sdist",
              "converter_patch": patched, "llama_repack": REPACK_NOTE if llama_repacks() else NO_REPACK_NOTE, "machine_before": machine(),
              "prepare_s": prepared,
              "commit": subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"],
                                       capture_output=True, text=True).stdout.strip(),
              "gguf_gb": {n: f.stat().st_size / 1e9 for n, f in files.items()}}
    if not args.skip_warm:
        report["ours_warm"] = warm_ours(model, images, list(dict.fromkeys(r[1] for r in rows)), args.threads, target, tmp,
                                        args.ours_vision_sizes, args.tasks, args.kv_cache_dtype)
    report["rounds"] = []
    for i in range(args.rounds):
        first = "ours" if i % 2 == 0 else "llama"
        print(f"round {i + 1}/{args.rounds} ({first} first), load {os.getloadavg()}", flush=True)
        report["rounds"].append({r[0]: one_round(first, r, model, images, files, bindir, args.threads, target, tmp,
                                                 args.ours_vision_sizes, args.tasks, args.kv_cache_dtype)
                                       for r in rows})
    if args.quality:
        logits_tool = build_logits_tool(src, bindir, work / "build.log")
        report["quality"] = quality(model, files, rows, logits_tool, args.threads, target, tmp)
    report["machine_after"] = machine()
    if "text" in args.tasks:
        from runtime.bench.roof import memory_bandwidth_gbs
        report["memory_bandwidth"] = memory_bandwidth_gbs(args.threads)
    report["summary"] = summarize(report["rounds"])
    report["table"] = table(report["summary"], bits_labels(report["rounds"]))
    m = report["machine_before"]
    print(f"\n{m['cpu']}, {m['cores']} cores, load {m['load_average']} -> {report['machine_after']['load_average']}")
    print(f"flags: {' '.join(m['flags'])}\n{patched}\n{report['llama_repack']}\n")
    print(report["table"])
    if "memory_bandwidth" in report:
        print("\n" + weight_traffic(report["rounds"], report["memory_bandwidth"]))
    if args.quality:
        print("\n" + quality_table(report["quality"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    chart = args.chart or (args.json.with_suffix(".svg") if args.json else None)
    if chart:
        print(write_ratio_chart(report, chart))


if __name__ == "__main__":
    main()
