"""Drives iree-compile: MLIR text in, vmfb bytes out."""

from __future__ import annotations

import iree.compiler as ireec

from emitter.targets import target_flags


class CompileError(RuntimeError):
    pass


def compile_mlir(text: str, target: str = "llvm-cpu", extra_flags=()) -> bytes:
    """Compile StableHLO text for `target` with the flags the identity records."""
    flags = [*target_flags(target), *extra_flags]
    try:
        return ireec.compile_str(text, extra_args=flags)
    except ireec.CompilerToolError as e:
        raise CompileError(f"iree-compile failed for target {target}:\n{e}") from None
