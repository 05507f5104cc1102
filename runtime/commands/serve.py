"""`qwen3vl serve`: the OpenAI-compatible chat server (see docs/serve.md)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import click

from emitter.config import DEFAULT_PRECISION_HELP, PRECISION_HELP, QUANT_HELP, TEXT_PRECISIONS

from emitter.text import KV_CACHE_HELP, KV_DTYPES

from runtime.text import CONTEXT_LADDER, DEFAULT_PROMPT_BUCKETS

CONTEXT = {"help_option_names": ["-h", "--help"]}


def prompt_buckets(buckets, context: int) -> tuple[int, ...]:
    """The asked buckets, else the default ones that fit the context (the context itself
    when none does)."""
    if buckets:
        return tuple(buckets)
    return tuple(b for b in DEFAULT_PROMPT_BUCKETS if b <= context) or (context,)


def positive(name: str, value: int) -> int:
    if value < 1:
        raise ValueError(f"{name} {value}: expected 1 or more")
    return value


@click.command("serve", context_settings=CONTEXT)
@click.option("--model", required=True, metavar="DIR", help="Checkpoint folder (as for qwen3vl generate).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (one other than loopback, without --api-key: a warning).")
@click.option("--port", type=int, default=8000, show_default=True, help="TCP port.")
@click.option("--max-batch", type=int, default=4, show_default=True, metavar="N",
              help="Sequences decoded together (decode lanes on the device); more requests wait in the queue.")
@click.option("--context", type=int, metavar="N",
              help="Tokens a sequence may hold (prompt and answer). Default: "
                   f"{CONTEXT_LADDER[-1]}, at most the model's max_position_embeddings and what half the available "
                   "memory holds.")
@click.option("--kv-cache-dtype", type=click.Choice(KV_DTYPES), default="f32", show_default=True,
              help=KV_CACHE_HELP)
@click.option("--kv-cache-memory", type=float, metavar="GB",
              help="Memory of the paged KV cache, shared by all sequences (default: a whole context for each of "
                   "--max-batch sequences, at most half the free memory, at least one context).")
@click.option("--prompt-bucket", "buckets", multiple=True, type=int, metavar="N",
              help="Prefill bucket in tokens (repeatable; default those of "
                   f"{' '.join(map(str, DEFAULT_PROMPT_BUCKETS))} within the context); a longer prompt runs in "
                   "chunks of the largest.")
@click.option("--precision", type=click.Choice(TEXT_PRECISIONS), default=None,
              help=f"{PRECISION_HELP} {QUANT_HELP} {DEFAULT_PRECISION_HELP}")
@click.option("--api-key", metavar="KEY", envvar="QWEN3VL_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/ (or $QWEN3VL_API_KEY; an empty key is refused).")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="HOST",
              help="Also answer requests whose Host header names HOST (repeatable; '*': any). By default only "
                   "the --host address and the loopback names are answered (421 otherwise: DNS rebinding).")
@click.option("--allowed-local-media-path", metavar="DIR",
              help="Accept file:// image and video URLs, only for files under DIR (symlinks resolved).")
@click.option("--cache-dir", metavar="DIR", help="Artifact cache folder.")
@click.option("--threads", type=int, metavar="N", help="IREE worker threads, 1 or more (default: one per core).")
@click.option("--target", default=None, metavar="T", help="Compile target (default llvm-cpu).")
@click.option("--max-waiting", type=int, default=16, show_default=True, metavar="N",
              help="Requests that may wait for the engine; more get 429 with Retry-After.")
@click.option("--max-media", type=int, default=8, show_default=True, metavar="N",
              help="Images and videos per request.")
@click.option("--max-body-mb", type=int, default=32, show_default=True, metavar="MB", help="Request body limit.")
@click.option("--encoder-cache-mb", type=int, default=512, show_default=True, metavar="MB",
              help="Bytes of image/video embeddings kept for reuse (LRU).")
@click.option("--prompt-cache/--no-prompt-cache", default=True, show_default=True,
              help="Prefix caching by blocks: a prompt whose first blocks of 16 tokens (text, positions and "
                   "images) the KV cache holds shares them and prefills only the rest (exact: the same answer).")
@click.option("--grace", type=float, default=10.0, show_default=True, metavar="S",
              help="On SIGTERM: seconds to let requests in flight finish; then each still running gets a 503 "
                   "error object (a stream: an error event, then [DONE]).")
@click.option("--image-min-tokens", type=int, metavar="N",
              help="Least tokens an image may take (bounds the checkpoint's and each request's mm_processor_kwargs).")
@click.option("--image-max-tokens", type=int, metavar="N",
              help="Most tokens an image may take (bounds the checkpoint's and each request's mm_processor_kwargs).")
def serve_command(model, host, port, max_batch, context, kv_cache_dtype, kv_cache_memory, buckets, precision, api_key,
                  allowed_hosts, allowed_local_media_path,
                  cache_dir, threads, target, max_waiting, max_media, max_body_mb, encoder_cache_mb, prompt_cache,
                  grace, image_min_tokens, image_max_tokens):
    """Serve the checkpoint over OpenAI's chat completions API (FastAPI + uvicorn). Everything
    is compiled and loaded before the first request is accepted."""
    for name, value in (("--max-batch", max_batch), ("--max-waiting", max_waiting), ("--max-media", max_media),
                        ("--max-body-mb", max_body_mb), ("--encoder-cache-mb", encoder_cache_mb)):
        positive(name, value)
    for name, value in (("--image-min-tokens", image_min_tokens), ("--image-max-tokens", image_max_tokens)):
        if value is not None:
            positive(name, value)
    if image_min_tokens and image_max_tokens and image_min_tokens > image_max_tokens:
        raise ValueError(f"--image-min-tokens {image_min_tokens} > --image-max-tokens {image_max_tokens}")
    if allowed_local_media_path and not Path(allowed_local_media_path).is_dir():
        raise ValueError(f"--allowed-local-media-path {allowed_local_media_path}: not a folder")
    check_access(host, api_key)
    if context is None:
        from runtime.text import default_context

        context, why = default_context(model, kv_cache_dtype)
        click.echo(f"context: {context} tokens ({why}; --context to change)", err=True)
    server = build_server(model, host, port, max_batch, context, prompt_buckets(buckets, context), precision, api_key,
                          allowed_local_media_path, cache_dir, threads, target, max_waiting, max_media,
                          max_body_mb, encoder_cache_mb, prompt_cache, grace, kv_cache_dtype,
                          kv_cache_memory, allowed_hosts,
                          (image_min_tokens, image_max_tokens))  # bad input, failures: one line
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # uvicorn takes it over: a graceful stop, exit 0
    server.run()


def check_access(host: str, api_key: str | None) -> None:
    """An empty key is refused (it would turn authentication off unseen); a server reachable
    from other machines without a key is warned about."""
    from runtime.serve.guard import is_loopback

    if api_key is None and os.environ.get("QWEN3VL_API_KEY") == "":  # click reads an empty variable as unset
        api_key = ""
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key (or $QWEN3VL_API_KEY): empty; give a key, or leave both unset to serve "
                         "without one")
    if not api_key and not is_loopback(host):
        click.echo(f"warning: --host {host} without --api-key: anyone who can reach this address may use the "
                   "server", err=True)


def build_server(model, host, port, max_batch, context, buckets, precision, api_key, allowed, cache_dir, threads,
                 target, max_waiting, max_media, max_body_mb, encoder_cache_mb, prompt_cache, grace,
                 kv_cache_dtype="f32", kv_cache_memory=None, allowed_hosts=(), image_tokens=(None, None)):
    """Everything loaded (text module, vision module, weights), then a uvicorn server."""
    from runtime.text import Generator, kv_blocks
    from runtime.serve.app import Limits, create_app
    from runtime.serve.guard import allowed_hosts as host_names
    from runtime.serve.server import GracefulServer
    from runtime.serve.image_budget import ImageBudget
    from runtime.serve.encoder_cache import EncoderCache
    from runtime.serve.metrics import Metrics
    from runtime.serve.scheduler import Engine

    def say(message: str) -> None:
        click.echo(message, err=True)

    blocks, note = kv_blocks(model, buckets, context, max_batch, kv_cache_dtype, kv_cache_memory)
    say(f"KV cache: {note}")
    generator = Generator(model, buckets, context, target=target, cache_dir=cache_dir, precision=precision,
                          threads=threads, progress=say, kv_cache_dtype=kv_cache_dtype, lanes=max_batch,
                          kv_blocks=blocks, prefix_cache=prompt_cache)
    generator.text.module  # noqa: B018 - compiled and loaded now, not at the first request
    generator.vision.artifact()
    metrics = Metrics()
    encoder = EncoderCache(generator.vision_for, encoder_cache_mb << 20, metrics)
    engine = Engine(generator, metrics, encoder, max_waiting)
    limits = Limits(api_key, allowed, max_body_mb << 20, max_media, allowed_hosts=host_names(host, port, allowed_hosts),
                    image_budget=ImageBudget(*image_tokens))
    model_id = Path(model).resolve().name
    url = f"http://{host}:{port}/v1"
    app = create_app(generator, engine, metrics, model_id, limits,
                     on_ready=lambda: say(f"qwen3vl serve: {model_id} ready at {url}"))
    return GracefulServer(app, engine.cut, grace, host=host, port=port, log_level="warning")
