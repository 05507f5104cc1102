"""`qwen3vl embed`: a collection of images to feature shards, locally or on Ray Data; on an
embedding model (Qwen3-VL-Embedding), items to retrieval vectors (runtime/jobs/retrieval.py)."""

from __future__ import annotations

import sys

import click

from emitter.cli import precision_option
from emitter.precision import VISION_CHOICES
from emitter.errors import EXIT_FAILED, command_errors

from runtime.commands.options import CONTEXT, cache_dir_option, packed_buckets_option, target_option, threads_option
from runtime.embedding import POOLING_CHOICES
from runtime.jobs.embed import FORMATS

SOME_FAILED = EXIT_FAILED  # exit status when an image could not be embedded (recorded in the index)


@click.command("embed", context_settings=CONTEXT)
@click.option("--model", required=True, metavar="DIR", help="Checkpoint folder (HF or MLX layout).")
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click.option("-o", "--output", "out_dir", required=True, metavar="OUT_DIR",
              help="Folder for shard-NNNNN.safetensors and index.json (created if missing; a rerun resumes).")
@click.option("--batch", type=int, default=16, show_default=True, metavar="N",
              help="Images per engine call and per shard.")
@click.option("--ray-local", type=int, metavar="N", help="Run on Ray Data: start a local cluster with N workers.")
@click.option("--ray", "ray_address", metavar="ADDRESS", help="Run on Ray Data: join the cluster at ADDRESS.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="native", show_default=True,
              help="native: image_embeds and deepstack_features; vllm: the one tensor vLLM takes (docs/embed.md).")
@precision_option(VISION_CHOICES)
@packed_buckets_option
@target_option
@cache_dir_option
@threads_option("one per core locally, 1 per Ray actor")
@click.option("--pooling", type=click.Choice(POOLING_CHOICES),
              help="Write retrieval vectors of an embedding model (a checkpoint whose modules.json or model card "
                   "says so is one without it; docs/embed.md, Retrieval vectors).")
@click.option("--normalize/--no-normalize", default=None,
              help="Retrieval vectors: L2-normalized (default: the checkpoint's Normalize module, else on).")
@click.option("--instruction", metavar="TEXT",
              help="Retrieval vectors: the system instruction (default \"Represent the user's input.\").")
@click.option("--dimensions", type=int, metavar="N", help="Retrieval vectors: the first N values (Matryoshka).")
@click.option("--context", type=int, metavar="N",
              help="Retrieval vectors: the tokens an item may take (default: fitted to each item; docs/text.md).")
@click.option("--retry-failed", is_flag=True, help="Try again the images the index records as failed.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def embed_command(model, inputs, out_dir, batch, ray_local, ray_address, fmt, precision, buckets, target, cache_dir,
                  threads, pooling, normalize, instruction, dimensions, context, retry_failed,
                  no_progress):
    """Embed INPUT... (image files, folders of images searched recursively, or .txt files
    listing image paths) into OUT_DIR/shard-NNNNN.safetensors (image_embeds,
    deepstack_features, grid_thw; rows in image order) and OUT_DIR/index.json (per image:
    shard, first row, rows, grid_thw; or the one-line reason it failed).

    A rerun skips the images already in the index. An image that cannot be read or (with
    --bucket) fits no bucket is recorded as failed and the job goes on; the exit status is 1 when any
    image of INPUT... failed.

    On an embedding model (its sentence-transformers files or model card, or --pooling last),
    it writes retrieval vectors instead, one row per item: image files and folders, .txt files (one
    text a line) and .jsonl files ({image, text, instruction} a line), into
    OUT_DIR/vectors-NNNNN.safetensors and OUT_DIR/index.json, resumable the same way, locally or
    on Ray Data alike."""
    from runtime.embedding import resolve_pooling
    from runtime.jobs.embed import embed

    def say(message: str) -> None:
        click.echo(message, err=True)

    with command_errors():
        found = resolve_pooling(model, pooling, normalize)
        if found is None and (instruction, dimensions, context) != (None, None, None):
            raise ValueError("--instruction/--dimensions/--context: only for an embedding model (--pooling last, or "
                             "a checkpoint whose modules.json says last-token pooling)")
        if found is not None:
            return retrieval(model, inputs, out_dir, batch, found, instruction, dimensions, context, fmt, precision,
                             buckets, target, cache_dir, threads, ray_local, ray_address, retry_failed, say,
                             no_progress)

    with command_errors():  # a Ray failure (EngineError) keeps the shards and index written so far
        summary = embed(model, inputs, out_dir, batch, fmt, precision, buckets or None, target, cache_dir, threads,
                        ray_local, ray_address, retry_failed, say, progress_bar=not no_progress)
    click.echo(summary.line())
    if summary.failed:
        say(f"error: {summary.failed} images failed (reasons in {summary.index})")
        sys.exit(SOME_FAILED)


def retrieval(model, inputs, out_dir, batch, pooling, instruction, dimensions, context, fmt, precision, buckets,
              target, cache_dir, threads, ray_local, ray_address, retry_failed, say, no_progress) -> None:
    """An embedding model's retrieval vectors (runtime/jobs/retrieval.py), in this process or on Ray Data."""
    from runtime.jobs.retrieval import embed_items

    if fmt != "native" or buckets:
        raise ValueError("--format/--bucket: options of the vision tower's features; an embedding model writes "
                         "retrieval vectors")
    say(f"embedding model: {pooling.describe()}; writing retrieval vectors")
    summary = embed_items(model, inputs, out_dir, pooling, batch, instruction, dimensions, precision, target,
                          cache_dir, threads, retry_failed, say, progress_bar=not no_progress, context=context,
                          ray_local=ray_local, ray_address=ray_address)
    click.echo(summary.line())
    if summary.failed:
        say(f"error: {summary.failed} items failed (reasons in {summary.index})")
        sys.exit(SOME_FAILED)
