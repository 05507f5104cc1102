"""`emit-qwen3vl`: print or write the vision graph for one bucket."""

from __future__ import annotations

import sys

import click

from .atomic import check_writable, write_atomic
from .config import DEFAULT_PRESET, resolve_config
from .errors import command_errors, fail  # noqa: F401 - fail: the commands' one-line exit
from .precision import VISION_PRECISIONS, help_text, precision
from .vision import parse_bucket


class PrecisionChoice(click.Choice):
    """--precision: one of `choices`, given to the command as its `emitter.precision.Precision`
    (the one place a command line's precision name is resolved)."""

    def convert(self, value, param, ctx):
        return value if value is None else precision(super().convert(value, param, ctx))


def precision_option(choices, default="f32", help: str | None = None):
    """The --precision option over `choices`, its help a line a choice (`precision.help_text`)."""
    return click.option("--precision", type=PrecisionChoice(list(choices)), default=default,
                        show_default=default is not None, help=help or help_text(choices))


def write_stdout(text: str) -> None:
    """All of `text` on stdout, or OSError when stdout is closed or goes away."""
    if sys.stdout is None:  # started with stdout closed
        raise OSError("stdout is closed; give -o FILE")
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):  # reader gone, or stdout closed meanwhile
        sys.stdout = None  # nothing left to flush at exit
        raise OSError("stdout closed before all of the output was written; give -o FILE") from None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--bucket", required=True, metavar="N",
              help="Most patches per call (a positive multiple of 4); the rows are a run-time count up to it.")
@click.option("--model", metavar="DIR", help="Checkpoint folder: reads its config.json.")
@click.option("--preset", "preset_name", metavar="NAME",
              help=f"A named config (see `qwen3vl presets`); default {DEFAULT_PRESET}.")
@click.option("--diagnostics", is_flag=True, help="Append the named intermediate stages to the results.")
@click.option("--inspect-block", "inspect_blocks", type=int, multiple=True, metavar="N",
              help="With --diagnostics: a block whose inner stages to return (repeatable; "
                   "default the first and the last block).")
@precision_option(VISION_PRECISIONS, help="f32; bf16: matmul weights and operands in bf16; bf16-f32: bf16 weights "
                  "widened to f32 inside each matmul (see docs/precisions.md).")
@click.option("--weights", type=click.Choice(["arguments", "parameters"]), default="arguments", show_default=True,
              help="Weights as function arguments, or as globals read from a parameter archive (scope `model`).")
@click.option("--explain", is_flag=True,
              help="Print the artifact identity (sha256) and the fields it hashes, instead of MLIR.")
@click.option("--target", default=None, metavar="T", help="With --explain: the compile target (default llvm-cpu).")
@click.option("-o", "--output", metavar="FILE", help="Write the MLIR here instead of stdout.")
def emit_main(bucket, model, preset_name, diagnostics, inspect_blocks, precision, weights, explain, target, output):
    """Emit the Qwen3-VL vision tower (all DeepStack mergers) for one bucket as StableHLO MLIR.

    With no --model or --preset it emits the Qwen3-VL-2B preset, so it needs no files.
    """
    from .vision import emit_vision_module

    with command_errors():
        bucket = parse_bucket(bucket)
        cfg, title = resolve_config(model, preset_name)
        inspect = tuple(inspect_blocks) if inspect_blocks else None
        if inspect and not diagnostics:
            raise ValueError(f"--inspect-block {inspect[0]}: needs --diagnostics (it picks which blocks' stages "
                             f"the diagnostics variant returns)")
        if output:
            check_writable(output, "-o")
        if explain:
            from .identity import explain_identity
            text = explain_identity(cfg, bucket, diagnostics=diagnostics, inspect_blocks=inspect,
                                    model_dir=model, target=target, precision=precision, weights=weights)
        else:
            text = emit_vision_module(cfg, bucket, diagnostics=diagnostics, inspect_blocks=inspect, title=title,
                                      precision=precision, weights=weights)
        if output:
            write_atomic(output, text)
        else:
            write_stdout(text)
