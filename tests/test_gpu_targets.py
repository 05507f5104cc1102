"""GPU targets cross-compile on a machine without a GPU (running them needs the device)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from emitter.targets import TARGETS

QWEN3VL = [sys.executable, "-c", "from runtime.commands.main import main; main()"]
FORMATS = {"cuda-sm80": b"cuda-nvptx-fb", "rocm-gfx942": b"rocm-hsaco-fb", "vulkan-spirv": b"vulkan-spirv-fb"}


def test_every_gpu_target_is_covered():
    assert sorted(FORMATS) == sorted(t for t in TARGETS if not t.startswith("llvm-cpu"))


@pytest.mark.parametrize("target", sorted(FORMATS))
def test_gpu_target_builds_a_vmfb(tmp_path, target):
    out = subprocess.run([*QWEN3VL, "build", "--preset", "tiny", "--bucket", "16", "--target", target,
                          "--cache-dir", str(tmp_path)], capture_output=True, text=True, timeout=180,
                         env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    path = out.stdout.split()[-1]
    assert " built " in out.stdout and path.endswith(".vmfb")
    data = open(path, "rb").read()
    assert FORMATS[target] in data and b"embedded-elf" not in data
