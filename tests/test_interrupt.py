"""A signal during a long IREE call: the command unwinds at once (SIGTERM's handler runs
while the call computes, on a call thread), exits 143 with its one-line error, and does
not wait for the call, which at bucket 16384 on the 2B tower takes minutes. Ctrl-C
(SIGINT) likewise, during a call or a compile: one `error:` line and exit 130.

The tests wait on events, not on the clock, so they hold on a busy machine: the signal
is sent once the child's call is computing (its CPU time grows after it said "calling"),
or once iree-compile is its child; the call never ends by itself (2**31 steps); the
timeouts are only upper bounds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import exec_after

WORKER = r"""
import signal, sys, time
import numpy as np
from emitter.builder import Builder
from emitter.layers import matmul
from emitter.vision import render_functions
from runtime.commands.main import terminated
from runtime.artifact.compiler import compile_mlir
from runtime.artifact.iree_module import LoadedModule

b = Builder()
x = b.argument("x", (512, 512), "f32")
steps = b.argument("steps", (), "i32")
def body(i, acc):  # steps matmuls of 512x512: about 2 ms each, 2**31 of them: weeks
    return [b.add(i, b.constant(1, (), "i32")), b.multiply(matmul(b, acc, x, ([1], [0])), b.scalar(1e-3, acc))]
_, out = b.while_loop([b.constant(0, (), "i32"), x], lambda i, acc: b.compare("LT", i, steps), body)
module = LoadedModule(compile_mlir(render_functions([{"name": "main", "arguments": b.arguments,
                                                      "results": [("out", out)], "body": b.lines}], b.globals)))
signal.signal(signal.SIGTERM, terminated)
eye = np.eye(512, dtype=np.float32)
module(eye, np.int32(2))  # loaded and warm
print("calling", flush=True)
module(eye, np.int32(2**31 - 1))  # only a signal ends it
print("returned", flush=True)
"""


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def computing(child: subprocess.Popen) -> None:
    """Returns once `child` has said "calling" and its call has run 0.3 s of CPU time
    (however busy the machine, it is then inside the call)."""
    line = child.stdout.readline()
    assert line.startswith("calling"), (line, child.stderr.read() if child.poll() is not None else "")
    start = cpu_seconds(child.pid)
    deadline = time.monotonic() + 600  # an upper bound only
    while cpu_seconds(child.pid) < start + 0.3:
        assert child.poll() is None and time.monotonic() < deadline, child.stderr.read()
        time.sleep(0.05)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads CPU time from /proc")
def test_sigterm_during_a_long_call_exits_at_once():
    child = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        computing(child)
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=120)  # the call itself has weeks left: exiting at all is exiting at once
    finally:
        child.kill()
        child.wait()
    stderr = child.stderr.read()
    assert child.returncode == 128 + signal.SIGTERM, stderr
    assert stderr.strip().splitlines() == ["error: terminated (SIGTERM)"]  # no teardown noise
    assert "returned" not in child.stdout.read()


FORKED = r"""
import os, signal
from runtime.artifact.iree_module import invoke
assert invoke(lambda: 1 + 1) == 2  # the parent's call thread is running
pid = os.fork()
if pid == 0:  # the thread did not survive the fork: the child starts its own
    signal.alarm(60)  # a child left waiting for a thread that is not there dies here (an upper bound)
    os._exit(0 if invoke(lambda: 2 + 2) == 4 else 1)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_makes_its_own_calls():
    done = subprocess.run([sys.executable, "-c", FORKED], capture_output=True, text=True, timeout=180,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.stdout.strip() == "child 0", done.stderr


# --------------------------------------------------------------------------- Ctrl-C

INTERRUPTED = WORKER.replace("from runtime.commands.main import terminated", "from emitter.errors import command_errors").replace(
    "signal.signal(signal.SIGTERM, terminated)\n", "").replace(
    'print("calling", flush=True)\nmodule(eye, np.int32(2**31 - 1))',
    'with command_errors():\n    print("calling", flush=True)\n    module(eye, np.int32(2**31 - 1))')
assert "with command_errors()" in INTERRUPTED


def as_in_a_terminal(command: list[str]) -> list[str]:
    """`command` with its SIGINT handled by default, as under a terminal's shell, whatever the
    test runner inherited (a shell's background job starts with SIGINT ignored, and Python
    then installs no Ctrl-C handler): the Ctrl-C tests' children."""
    return exec_after("import signal; signal.signal(signal.SIGINT, signal.SIG_DFL)", command)


def interrupted(child: subprocess.Popen, wait_for) -> tuple[int, str]:
    """Ctrl-C (SIGINT to the process alone) once `wait_for()` is true: (exit status, stderr)."""
    try:
        deadline = time.monotonic() + 600  # upper bounds only: a busy machine is slow, not wrong
        while not wait_for():
            assert child.poll() is None and time.monotonic() < deadline, child.stderr.read()
            time.sleep(0.05)
        child.send_signal(signal.SIGINT)
        child.wait(timeout=120)
        return child.returncode, child.stderr.read()
    finally:
        child.kill()
        child.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads CPU time from /proc")
def test_ctrl_c_during_a_long_call_is_one_line_and_130():
    child = subprocess.Popen(as_in_a_terminal([sys.executable, "-c", INTERRUPTED]), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    status, stderr = interrupted(child, lambda: computing(child) is None)
    assert status == 130, stderr
    assert stderr.strip().splitlines() == ["error: interrupted (SIGINT)"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds iree-compile in /proc")
def test_ctrl_c_during_a_compile_is_one_line_and_130(tmp_path):
    from test_bad_input import children_named

    qwen3vl = str(Path(sys.executable).parent / "qwen3vl")
    child = subprocess.Popen(as_in_a_terminal([qwen3vl, "build", "--preset", "qwen3-vl-2b", "--bucket", "64",
                                               "--cache-dir", str(tmp_path)]),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    status, stderr = interrupted(child, lambda: children_named(child.pid, "iree-compile"))
    assert status == 130, stderr
    assert stderr.strip().splitlines()[-1] == "error: interrupted (SIGINT)" and "Aborted" not in stderr
    assert not list(tmp_path.rglob("*.vmfb"))
