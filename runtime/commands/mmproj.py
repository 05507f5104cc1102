"""`--mmproj FILE` (llama.cpp's name): the vision GGUF beside a GGUF text `--model`, for
generate, serve and run."""

from __future__ import annotations

import click

mmproj_option = click.option(
    "--mmproj", metavar="FILE",
    help="llama.cpp's mmproj GGUF (the vision tower) for a GGUF text --model; a folder holding both "
         "needs none (docs/text.md).")


def with_mmproj(model, mmproj, cache_dir):
    """The model the commands read: `model` itself, or with `mmproj` a folder of links to
    both files in the artifact cache (`gguf_vision.paired_model`)."""
    if not mmproj:
        return model
    from runtime.artifact.cache import ArtifactCache
    from runtime.checkpoints.gguf_vision import paired_model

    return str(paired_model(model, mmproj, ArtifactCache(cache_dir).ensure_root()))
