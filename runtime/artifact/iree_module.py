"""A compiled module loaded on an IREE device, with arrays kept resident."""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import platform
import queue
import re
import sys
import threading

import numpy as np
import iree.runtime as rt

from emitter.config import PARAMETER_SCOPE
from emitter.targets import runtime_driver


class DeviceMemoryError(MemoryError):
    """IREE could not allocate what a call needs (RESOURCE_EXHAUSTED)."""


# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
KEEP_BELOW = 1 << 30  # bytes: allocations under this come from the heap and stay there when freed


@functools.cache  # the whole process, once
def keep_freed_memory() -> None:
    """Let freed host memory be reused instead of returned to the kernel (glibc only; the
    whole process, once). IREE's CPU device allocates each call's transient buffers with
    malloc; glibc serves those over 32 MiB with a fresh mmap and unmaps them on free, so
    every call faulted in every page again. At bucket 16384 that was 310 million page
    faults and 40% of the CPU time in the kernel (docs/history/performance-notebook.md, "Large inputs");
    at 512 nothing is that large and the time is unchanged. One arena, because `invoke`
    calls from a helper thread and a thread's own arena mmaps anything over 64 MiB.
    A host process that manages its own allocator (a server, a Ray worker) sets
    QWEN3VL_KEEP_FREED_MEMORY=0 to leave malloc as it is (docs/design.md, "Process-wide
    settings")."""
    if platform.libc_ver()[0] != "glibc" or os.environ.get("QWEN3VL_KEEP_FREED_MEMORY", "1") == "0":
        return
    libc = ctypes.CDLL(None)
    libc.mallopt(M_ARENA_MAX, 1)  # every thread in the main heap (a thread's own arena mmaps over 64 MiB)
    libc.mallopt(M_MMAP_THRESHOLD, KEEP_BELOW)
    libc.mallopt(M_TRIM_THRESHOLD, 2 * KEEP_BELOW)


def return_freed_memory() -> None:
    """Give the kernel back the pages of freed heap memory (glibc's `malloc_trim(0)`; a no-op
    elsewhere): after a session is let go (its weights freed into the heap that
    `keep_freed_memory` keeps), so that they are not counted resident until reused."""
    if platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(None).malloc_trim(0)


def device_config(target: str) -> rt.Config:
    """The IREE runtime config (driver and device) for a compile target; a ValueError
    naming the target and the missing driver when this machine cannot make the device.
    Also `keep_freed_memory`, for the calls on that device."""
    keep_freed_memory()
    driver = runtime_driver(target)
    try:
        return rt.Config(driver)
    except (RuntimeError, ValueError) as e:
        detail = str(e.__cause__ or e).splitlines()[0]
        detail = re.sub(r"^.*?: [A-Z_]+; ", "", detail)  # drop "Error creating driver: file.c:66: UNAVAILABLE; "
        raise ValueError(f"--target {target}: this machine cannot create an IREE '{driver}' device "
                         f"({detail})") from None


def _out_of_memory(e: RuntimeError) -> RuntimeError:
    """IREE's allocation failures as DeviceMemoryError, anything else unchanged."""
    if "RESOURCE_EXHAUSTED" not in str(e):
        return e
    reason = re.search(r"RESOURCE_EXHAUSTED; ([^;]*)", str(e))
    return DeviceMemoryError(reason.group(1) if reason else "RESOURCE_EXHAUSTED")


def invoke(function, *args):
    """function(*args), an IREE call, waited for so that a signal's Python handler (SIGTERM,
    Ctrl-C) runs at once rather than when a call of minutes returns: from the main thread the
    call runs on the `_call_thread` (IREE releases the GIL while it computes) and the main
    thread waits on it. If the handler raises, the call is abandoned to finish on its own."""
    if threading.current_thread() is not threading.main_thread():
        return function(*args)
    done = queue.SimpleQueue()
    _call_thread().put((function, args, done))
    try:
        ok, value = _result(done)
    except BaseException as e:  # the handler raised (SystemExit, KeyboardInterrupt): unwind now
        _abandoned.append(e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else
                          130 if isinstance(e, KeyboardInterrupt) else 1)
        raise
    if not ok:
        raise value
    return value


def _result(done: queue.SimpleQueue):
    """The call's (ok, value), waited for in short waits: a signal's handler runs between them."""
    while True:
        try:
            return done.get(timeout=0.5)
        except queue.Empty:
            pass


@functools.cache  # one for the process, started at the first call
def _call_thread() -> queue.SimpleQueue:
    """The queue of a daemon thread that runs the main thread's IREE calls one at a time (a
    thread started per call cost 120-250 us a call; this one, 60-70)."""
    calls = queue.SimpleQueue()

    def serve():
        while True:
            function, args, done = calls.get()
            try:
                done.put((True, function(*args)))
            except BaseException as e:  # handed to the waiting thread
                done.put((False, e))
            del function, args, done  # hold nothing between calls (nanobind reports what is alive at exit)

    threading.Thread(target=serve, name="iree-call", daemon=True).start()
    return calls


os.register_at_fork(after_in_child=_call_thread.cache_clear)  # a forked child has no such thread: it starts its own


_abandoned: list[int] = []  # exit codes of the unwinds that left an IREE call running


@atexit.register  # at import, so it runs after the handlers registered later
def _exit_if_abandoned() -> None:
    """After an abandoned call, end the process here: finalizing the interpreter under a
    running IREE call would tear down the objects it uses (and nanobind reports them)."""
    if _abandoned:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_abandoned[0])


class LoadedModule:
    """One vmfb in its own context. `upload` makes device arrays once; `__call__` (the
    function named at load, `main` by default) and `call(name, ...)` take device arrays or
    numpy arrays (positional, in argument order) and return numpy copies."""

    def __init__(self, vmfb: bytes, driver: str = "local-task", function: str = "main",
                 module_name: str = "qwen3vl_vision", config: rt.Config | None = None, modules=()):
        # Modules sharing one config share its device, so one upload of the weights serves all.
        if config is None:
            keep_freed_memory()  # as device_config does
            config = rt.Config(driver)
        self.config = config
        self.context = rt.SystemContext(config=self.config)
        for module in modules:  # e.g. the parameter provider, before the module that needs it
            self.context.add_vm_module(module)
        self._vmfb = vmfb  # the module maps this buffer: keep it alive
        try:  # initializers run here (e.g. packing parameter-bound weights)
            self.context.add_vm_module(rt.VmModule.copy_buffer(self.config.vm_instance, vmfb))
        except RuntimeError as e:
            raise _out_of_memory(e) from None
        self.module = self.context.modules[module_name]
        self.function = self.module[function] if function else None

    def upload(self, array: np.ndarray):
        return rt.asdevicearray(self.config.device, np.asarray(array, order="C"))

    def __call__(self, *args) -> list[np.ndarray]:
        return self.call(None, *args)

    def call(self, function: str | None, *args) -> list[np.ndarray]:
        """Call an exported function by name (e.g. `encode_64`; None: the one named at load)."""
        try:
            results = invoke(self.module[function] if function else self.function, *args)
        except RuntimeError as e:
            raise _out_of_memory(e) from None
        if not isinstance(results, (list, tuple)):
            results = [results]
        # to_host() is a view a later call may overwrite: copy.
        return [np.array(r.to_host(), copy=True) for r in results]


def parameters_module(config: rt.Config, source, scope: str = PARAMETER_SCOPE) -> rt.VmModule:
    """An `io_parameters` module serving `source` under `scope` (the graphs' weight scope by
    default): a `ParameterIndex` (an archive, memory-mapped) or `(name, array)` pairs,
    referenced, not copied, which must stay alive as long as the module."""
    index = source
    if not isinstance(source, rt.ParameterIndex):
        index = rt.ParameterIndex()
        for name, array in source:  # raw bytes: the module knows each global's type (bf16 too)
            index.add_buffer(name, np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    return rt.create_io_parameters_module(config.vm_instance, index.create_provider(scope=scope))
