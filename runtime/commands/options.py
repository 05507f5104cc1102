"""The options several `qwen3vl` commands take, each defined once: the click decorators with
their one-line help (the long story is in docs/), and `text_options`, the options `generate`
and `serve` share, given to the command as one `TextOptions`."""

from __future__ import annotations

import dataclasses
import functools

import click

from emitter.cli import precision_option
from emitter.precision import TEXT_CHOICES, TEXT_HELP, Precision
from emitter.text_shape import KV_CACHE_HELP, KV_DTYPES

CONTEXT = {"help_option_names": ["-h", "--help"]}

target_option = click.option("--target", default=None, metavar="T", help="Compile target (default llvm-cpu).")
cache_dir_option = click.option("--cache-dir", metavar="DIR", help="Artifact cache folder (default "
                                "$QWEN3VL_CACHE_DIR, else the user cache folder).")
model_option = click.option(
    "--model", required=True, metavar="DIR|FILE",
    help="Checkpoint folder (HF or MLX), GGUF text file, or folder of a GGUF and its mmproj (docs/text.md).")
mmproj_option = click.option("--mmproj", metavar="FILE",
                             help="llama.cpp's mmproj GGUF (the vision tower) for a GGUF text --model.")
# The vision tower's commands:
patch_buckets_option = click.option(  # build, export, oracle
    "--bucket", "buckets", multiple=True, metavar="N",
    help="Most patches per call, a positive multiple of 4 (repeatable; default 512 16384; each entry "
         "takes any smaller count).")
packed_buckets_option = click.option(  # run, embed
    "--bucket", "buckets", multiple=True, type=int, metavar="N",
    help="Most patches per call (repeatable; default 512 16384, and a larger image alone in 16384: any "
         "size, one compile).")
weights_option = click.option("--weights", type=click.Choice(["parameters", "arguments"]), default="parameters",
                              show_default=True, help="parameters: an archive packed once at load (faster); "
                                                      "arguments: packed every call (docs/artifact.md).")


def threads_option(default: str = "one per core"):
    return click.option("--threads", type=int, metavar="N",
                        help=f"IREE worker threads, 1 or more (default: {default}).")


def with_mmproj(model, mmproj, cache_dir):
    """The model the commands read: `model` itself, or with `mmproj` a folder of links to
    both files in the artifact cache (`gguf_vision.paired_model`)."""
    if not mmproj:
        return model
    from runtime.artifact.cache import ArtifactCache
    from runtime.checkpoints.gguf_vision import paired_model

    return str(paired_model(model, mmproj, ArtifactCache(cache_dir).ensure_root()))


@dataclasses.dataclass(frozen=True)
class TextOptions:
    """What `generate` and `serve` open the language model with, as given on the command
    line. `precision` is already resolved (emitter/cli.py's `precision_option`); None: the
    checkpoint's own, which `runtime.text.checkpoint_precision` decides as the model opens."""
    model: str
    mmproj: str | None
    precision: Precision | None
    context: int | None
    kv_cache_dtype: str
    buckets: tuple[int, ...]
    cache_dir: str | None
    threads: int | None
    target: str | None

    def resolved(self) -> TextOptions:
        """With --mmproj, `model` is the folder pairing the two GGUF files (`with_mmproj`)."""
        return dataclasses.replace(self, model=with_mmproj(self.model, self.mmproj, self.cache_dir), mmproj=None)


def text_options(context_help: str, buckets_help: str, threads_default: str = "one per core"):
    """The options of `generate` and `serve` that open the language model, given to the
    command as one keyword argument, `text` (a `TextOptions`)."""
    fields = [f.name for f in dataclasses.fields(TextOptions)]
    options = [model_option, mmproj_option,
               precision_option(TEXT_CHOICES, default=None, help=TEXT_HELP),
               click.option("--context", type=int, metavar="N", help=context_help),
               click.option("--kv-cache-dtype", type=click.Choice(KV_DTYPES), default="f32", show_default=True,
                            help=KV_CACHE_HELP),
               click.option("--prompt-bucket", "buckets", multiple=True, type=int, metavar="N", help=buckets_help),
               cache_dir_option, threads_option(threads_default), target_option]

    def decorate(command):
        @functools.wraps(command)
        def with_text(**values):
            return command(text=TextOptions(**{name: values.pop(name) for name in fields}), **values)

        for option in reversed(options):
            with_text = option(with_text)
        return with_text
    return decorate
