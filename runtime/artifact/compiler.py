"""Drives iree-compile: MLIR text in, vmfb bytes out.

iree-compile runs as our own child process, tied to us: it is killed when we die
(PR_SET_PDEATHSIG on Linux, even on SIGKILL) or when the call is interrupted
(KeyboardInterrupt, SystemExit from a SIGTERM handler), so no compile outlives the
command that asked for it. The death signal is set by a small launcher that then execs
iree-compile (`tied_to_us`), not by a preexec_fn: Python code between fork and exec in a
process with threads can hang for good (the child's garbage collector once freed a PyAV
frame whose thread pool's condition variable then waited forever)."""

from __future__ import annotations

import os
import subprocess
import sys

from iree.compiler.tools.binaries import find_tool

from emitter.errors import Failure
from emitter.precision import Precision, for_graph
from emitter.targets import target_flags
from kernels.build import search_flags

# What iree.compiler.compile_str put before our flags; kept so the vmfb stays the same.
BASE_FLAGS = ("--iree-input-type=auto", "--iree-vm-bytecode-module-output-format=flatbuffer-binary",
              "--mlir-print-debuginfo", "--mlir-print-op-on-diagnostic=false")
# Run with `python -S -c LAUNCHER PARENT_PID COMMAND...` (no site, no threads): asks the kernel
# to SIGKILL it when its parent thread exits, leaves at once if the parent is already gone,
# then becomes COMMAND.
LAUNCHER = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0); "
            "os.getppid() == int(sys.argv[1]) or os._exit(1); os.execv(sys.argv[2], sys.argv[2:])")


class CompileError(Failure):
    """iree-compile failed: the first line says where, the rest is the compiler's output."""

    def one_line(self) -> str:
        """The first line and the compiler's first error line (what a command prints)."""
        lines = str(self).splitlines()
        reason = next((line.strip() for line in lines[1:] if "error:" in line),
                      lines[1].strip() if len(lines) > 1 else "")
        return f"{lines[0].rstrip(':')}: {reason}" if reason else lines[0]


def tied_to_us(command: list[str]) -> list[str]:
    """`command` started so that it is SIGKILLed when the thread that starts it exits
    (Linux; elsewhere `command` as it is)."""
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-S", "-c", LAUNCHER, str(os.getpid()), *command]


def compile_command(target: str = "llvm-cpu", extra_flags=()) -> list[str]:
    """The iree-compile command line: MLIR on stdin, vmfb on stdout; hand-written kernel
    objects a graph names by file name are found in their folder (`search_flags`)."""
    return [find_tool("iree-compile"), "-", *BASE_FLAGS, *target_flags(target), *search_flags(), *extra_flags]


# iree-compile's pace on a CPU target: about 10 core-seconds per MB of MLIR (on 2 quiet cores
# of a Zen 5, the 2B tower's two entries, 5.2 MB, in 18.5 s; its language model, 5.8 MB, in
# 36 s). A module's compile does not scale past a few cores.
COMPILE_CORE_SECONDS_PER_MB = 10


def compile_estimate(text: str) -> int:
    """About how many seconds iree-compile takes for `text` here, for a progress line."""
    cores = min(os.cpu_count() or 1, 8)
    return max(1, round(COMPILE_CORE_SECONDS_PER_MB * len(text) / 1e6 / cores))


def compile_mlir(text: str, target: str = "llvm-cpu", extra_flags=()) -> bytes:
    """Compile StableHLO text for `target` with the flags the identity records."""
    command = compile_command(target, extra_flags)
    # run() kills the child on any exception while waiting (KeyboardInterrupt, SystemExit).
    done = subprocess.run(tied_to_us(command), input=text.encode("utf-8"), capture_output=True)
    if done.returncode != 0:
        reason = (f"killed by signal {-done.returncode}" if done.returncode < 0
                  else f"exit status {done.returncode}")
        raise CompileError(f"iree-compile failed for target {target} ({reason}):\n"
                           f"{done.stderr.decode('utf-8', 'replace').strip()}")
    if done.stderr:  # warnings
        sys.stderr.write(done.stderr.decode("utf-8", "replace"))
    return done.stdout


_notes_said: set[str] = set()


def resolve_precision(precision: Precision | str, target: str | None = None, progress=None) -> Precision:
    """The precision to build for what a user asked on `target` (`Precision.for_target`); when
    it differs, `progress` hears why in one line, once per process."""
    precision = for_graph(precision)
    used = precision.for_target(target)
    note = precision.target_note(used, target)
    if note and progress and note not in _notes_said:
        _notes_said.add(note)
        progress(note)
    return used
