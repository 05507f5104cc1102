"""A signal during a long IREE call: the command unwinds at once (SIGTERM's handler runs
while the call computes, on a call thread), exits 143 with its one-line error, and does
not wait for the call, which at bucket 16384 on the 2B tower takes minutes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

WORKER = r"""
import signal, sys, time
import numpy as np
from emitter.builder import Builder
from emitter.layers import matmul
from emitter.vision import render_functions
from runtime.cli import terminated
from runtime.compiler import compile_mlir
from runtime.iree_module import LoadedModule

b = Builder()
x = b.argument("x", (512, 512), "f32")
steps = b.argument("steps", (), "i32")
def body(i, acc):  # steps matmuls of 512x512: about 2 ms each
    return [b.add(i, b.constant(1, (), "i32")), b.multiply(matmul(b, acc, x, ([1], [0])), b.scalar(1e-3, acc))]
_, out = b.while_loop([b.constant(0, (), "i32"), x], lambda i, acc: b.compare("LT", i, steps), body)
module = LoadedModule(compile_mlir(render_functions([{"name": "main", "arguments": b.arguments,
                                                      "results": [("out", out)], "body": b.lines}], b.globals)))
signal.signal(signal.SIGTERM, terminated)
eye = np.eye(512, dtype=np.float32)
start = time.perf_counter()
module(eye, np.int32(50))
per_step = (time.perf_counter() - start) / 50
print(f"calling {per_step:.6f}", flush=True)
module(eye, np.int32(int(60 / per_step)))  # about a minute
print("returned", flush=True)
"""


def test_sigterm_during_a_long_call_exits_at_once():
    child = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=Path(__file__).resolve().parents[1])
    line = child.stdout.readline()
    assert line.startswith("calling"), (line, child.stderr.read() if child.poll() is not None else "")
    time.sleep(1.0)  # inside the long call
    child.send_signal(signal.SIGTERM)
    sent = time.perf_counter()
    try:
        child.wait(timeout=20)
    finally:
        child.kill()
    waited = time.perf_counter() - sent
    stderr = child.stderr.read()
    assert child.returncode == 128 + signal.SIGTERM, stderr
    assert stderr.strip().splitlines() == ["error: terminated (SIGTERM)"]  # no teardown noise
    assert "returned" not in child.stdout.read()
    assert waited < 10, waited  # the call itself had about a minute left


FORKED = r"""
import os, signal
from runtime.iree_module import invoke
assert invoke(lambda: 1 + 1) == 2  # the parent's call thread is running
pid = os.fork()
if pid == 0:  # the thread did not survive the fork: the child starts its own
    signal.alarm(10)  # a child left waiting for a thread that is not there dies here
    os._exit(0 if invoke(lambda: 2 + 2) == 4 else 1)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_makes_its_own_calls():
    done = subprocess.run([sys.executable, "-c", FORKED], capture_output=True, text=True, timeout=30,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.stdout.strip() == "child 0", done.stderr
