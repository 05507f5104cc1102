"""llama.cpp's own GGUF converter, from a registry package's source: the llama-cpp-python
sdist vendors ggml-org/llama.cpp with `convert_hf_to_gguf.py` and its gguf-py. Shared by
benchmarks/bench_llamacpp.py and tests/test_gguf.py, so both read what the converter
really writes."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

PYTHON = sys.executable
VERSION = "0.3.36"
DEFAULT_WORK = Path.home() / ".cache" / "qwen3vl-iree" / "llamacpp"
PATCH_MARK = "patched by qwen3vl-iree benchmarks/bench_llamacpp.py: unknown hash -> qwen2"
PATCH_OLD = ('            raise NotImplementedError("BPE pre-tokenizer was not recognized - '
             'update get_vocab_base_pre()")')



def run_logged(cmd, log: Path, cwd=None, env=None) -> None:
    """Run `cmd` with its output appended to `log`; on failure raise with the log's tail."""
    with open(log, "a") as out:
        out.write(f"$ {' '.join(map(str, cmd))}\n")
        out.flush()
        rc = subprocess.call([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env)
    if rc:
        raise SystemExit(f"error: {cmd[0]} exited {rc}; last lines of {log}:\n" + "".join(open(log).readlines()[-20:]))


def fetch_source(work: Path, version: str) -> Path:
    """The sdist's vendored llama.cpp, downloaded and extracted once into `work`."""
    src = work / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (src / "convert_hf_to_gguf.py").exists():
        return src
    sdist = work / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        run_logged([PYTHON, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                    f"llama-cpp-python=={version}", "-d", work], work / "download.log")
    with tarfile.open(sdist) as tar:
        tar.extractall(work, filter="data")
    return src


def patch_converter(src: Path) -> str:
    """Map an unknown BPE pre-tokenizer hash to `qwen2` in the extracted converter (the
    random tokenizer's hash is in no list); idempotent. Returns what was done, in words."""
    base = src / "conversion" / "base.py"
    text = base.read_text()
    if PATCH_MARK not in text:
        if text.count(PATCH_OLD) != 1:
            raise SystemExit(f"error: {base}: the unknown-pre-tokenizer raise was not found once; cannot patch")
        base.write_text(text.replace(PATCH_OLD, f'            res = "qwen2"  # {PATCH_MARK}'))
    return f"converter patched at run time ({base.relative_to(src)}): an unknown BPE pre-tokenizer hash -> qwen2"



def convert(src: Path, checkpoint: Path, out: Path, args: list, log: Path) -> Path:
    """`convert_hf_to_gguf.py checkpoint *args` into `out` (written whole: to a temp name,
    then renamed), with the sdist's gguf-py; nothing done when `out` exists."""
    if not out.exists():
        tmp = out.with_name(out.stem + ".tmp.gguf")
        env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))
        run_logged([PYTHON, src / "convert_hf_to_gguf.py", checkpoint, *args, "--outfile", tmp], log, env=env)
        tmp.rename(out)
    return out
