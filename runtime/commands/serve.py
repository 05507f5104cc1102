"""`qwen3vl serve`: the OpenAI-compatible chat server (see docs/serve.md)."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from pathlib import Path

import click

from runtime.commands.options import CONTEXT, text_options
from runtime.embedding import POOLING_CHOICES
from runtime.serve.assemble import ServeOptions
from runtime.text import CONTEXT_LADDER, DEFAULT_PROMPT_BUCKETS, POOLING_PROMPT_BUCKETS


def prompt_buckets(buckets, context: int, pooled: bool = False) -> tuple[int, ...]:
    """The asked buckets, else the default ones (an embedding model's when `pooled`) that fit
    the context (the context itself when none does)."""
    if buckets:
        return tuple(buckets)
    defaults = POOLING_PROMPT_BUCKETS if pooled else DEFAULT_PROMPT_BUCKETS
    return tuple(b for b in defaults if b <= context) or (context,)


def positive(name: str, value: int) -> int:
    if value < 1:
        raise ValueError(f"{name} {value}: expected 1 or more")
    return value


@click.command("serve", context_settings=CONTEXT)
@text_options(context_help=f"Tokens a sequence may hold, prompt and answer (default {CONTEXT_LADDER[-1]}, as memory "
                           "allows; docs/text.md).",
              buckets_help="Prefill bucket in tokens (repeatable; default those of "
                           f"{' '.join(map(str, DEFAULT_PROMPT_BUCKETS))} within the context, an embedding model's "
                           f"{' '.join(map(str, POOLING_PROMPT_BUCKETS))}; docs/serve.md).",
              threads_default="one per core; 1 per replica with --ray")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (one other than loopback, without --api-key: a warning).")
@click.option("--port", type=int, default=8000, show_default=True, help="TCP port.")
@click.option("--max-batch", type=int, default=4, show_default=True, metavar="N",
              help="Sequences decoded together (decode lanes); more requests wait in the queue.")
@click.option("--kv-cache-memory", type=float, metavar="GB",
              help="Memory of the paged KV cache (default: a context per --max-batch sequence, as memory allows; "
                   "docs/serve.md).")
@click.option("--api-key", metavar="KEY", envvar="QWEN3VL_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/ (or $QWEN3VL_API_KEY; an empty key is refused).")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="HOST",
              help="Also answer requests whose Host header is HOST (repeatable; '*': any; docs/serve.md, Security).")
@click.option("--allowed-local-media-path", metavar="DIR",
              help="Accept file:// image and video URLs, only for files under DIR (symlinks resolved).")
@click.option("--max-waiting", type=int, default=16, show_default=True, metavar="N",
              help="Requests that may wait for the engine; more get 429 with Retry-After.")
@click.option("--max-media", type=int, default=8, show_default=True, metavar="N",
              help="Images and videos per request.")
@click.option("--max-body-mb", type=int, default=32, show_default=True, metavar="MB", help="Request body limit.")
@click.option("--encoder-cache-mb", type=int, default=512, show_default=True, metavar="MB",
              help="Bytes of image/video embeddings kept for reuse (LRU).")
@click.option("--prompt-cache/--no-prompt-cache", default=True, show_default=True,
              help="Prefix caching: a prompt's blocks the KV cache holds are shared, not prefilled (docs/serve.md).")
@click.option("--grace", type=float, default=10.0, show_default=True, metavar="S",
              help="On SIGTERM: seconds for requests in flight to finish; then each gets a 503 (docs/serve.md).")
@click.option("--image-min-tokens", type=int, metavar="N",
              help="Least tokens an image may take (bounds mm_processor_kwargs; docs/serve.md).")
@click.option("--image-max-tokens", type=int, metavar="N",
              help="Most tokens an image may take (bounds mm_processor_kwargs; docs/serve.md).")
@click.option("--hf-overrides", "--hf_overrides", "hf_overrides", metavar="JSON",
              help="vLLM's reranker fields, e.g. '{\"classifier_from_token\": [\"no\", \"yes\"]}': serve the model as "
                   "a reranker on /v1/rerank and /score (a Qwen3-VL-Reranker checkpoint is one without it; "
                   "docs/serve.md, Reranker).")
@click.option("--thinking-token-budget", type=int, metavar="N",
              help="Reasoning tokens a request may think before </think> is forced (a request's own "
                   "thinking_token_budget wins; default: no limit; docs/serve.md, Reasoning).")
@click.option("--web-ui/--no-web-ui", default=True, show_default=True,
              help="The chat page at / (docs/serve.md, The chat page).")
@click.option("--pooling", type=click.Choice(POOLING_CHOICES),
              help="Serve the model as an embedding model on /v1/embeddings: last-token pooling (vLLM's "
                   "--runner pooling; a checkpoint whose modules.json or model card says so is one without it; "
                   "docs/serve.md, Embeddings).")
@click.option("--normalize/--no-normalize", default=None,
              help="With --pooling: L2-normalize the vectors (default: the checkpoint's Normalize module, else on).")
@click.option("--ray", metavar="ADDRESS",
              help="Serve as replicas on Ray Serve: 'local', or a running cluster's HOST:PORT (docs/serve.md).")
@click.option("--replicas", type=int, default=1, show_default=True, metavar="N",
              help="With --ray: replicas, each one engine with its own caches (--threads CPUs each, default 1).")
@click.option("--min-replicas", type=int, metavar="N",
              help="With --ray: autoscale, down to N replicas (target: --max-batch ongoing requests each).")
@click.option("--max-replicas", type=int, metavar="N", help="With --ray: autoscale, up to N replicas.")
def serve_command(text, host, port, max_batch, kv_cache_memory, api_key, allowed_hosts, allowed_local_media_path,
                  max_waiting, max_media, max_body_mb, encoder_cache_mb, prompt_cache, grace, image_min_tokens,
                  image_max_tokens, hf_overrides, thinking_token_budget, web_ui, pooling, normalize, ray, replicas,
                  min_replicas, max_replicas):
    """Serve the checkpoint over OpenAI's chat completions API (FastAPI + uvicorn), or as
    replicas on Ray Serve (--ray). Everything is compiled and loaded before the first
    request is accepted."""
    for name, value in (("--max-batch", max_batch), ("--max-waiting", max_waiting), ("--max-media", max_media),
                        ("--max-body-mb", max_body_mb), ("--encoder-cache-mb", encoder_cache_mb)):
        positive(name, value)
    for name, value in (("--image-min-tokens", image_min_tokens), ("--image-max-tokens", image_max_tokens)):
        if value is not None:
            positive(name, value)
    if thinking_token_budget is not None and thinking_token_budget < 0:
        raise ValueError(f"--thinking-token-budget {thinking_token_budget}: expected 0 or more")
    if image_min_tokens and image_max_tokens and image_min_tokens > image_max_tokens:
        raise ValueError(f"--image-min-tokens {image_min_tokens} > --image-max-tokens {image_max_tokens}")
    if allowed_local_media_path and not Path(allowed_local_media_path).is_dir():
        raise ValueError(f"--allowed-local-media-path {allowed_local_media_path}: not a folder")
    check_access(host, api_key)
    text = text.resolved()
    pooling = embedding_pooling(text.model, pooling, normalize)
    classifier = reranker_tokens(text.model, hf_overrides)
    if classifier and pooling is not None:
        raise ValueError("a reranker (--hf-overrides, or its README) that is also an embedding model (--pooling, or its "
                         "modules.json): the model is one or the other")
    scaling = check_replicas(ray, replicas, min_replicas, max_replicas)
    context = text.context
    if context is None:
        from runtime.sizing import default_context, weight_bytes

        context, why = default_context(text.model, text.kv_cache_dtype,
                                       weight_bytes(text.model, text.precision, text.target))
        click.echo(f"context: {context} tokens ({why}; --context to change)", err=True)
    buckets = prompt_buckets(text.buckets, context, pooled=pooling is not None)
    options = ServeOptions(text.model, context, buckets, host, port, max_batch, text.precision, api_key,
                           allowed_local_media_path, text.cache_dir, text.threads, text.target,
                           max_waiting, max_media, max_body_mb, encoder_cache_mb, prompt_cache, grace,
                           text.kv_cache_dtype, kv_cache_memory, tuple(allowed_hosts),
                           (image_min_tokens, image_max_tokens), classifier_tokens=classifier, web_ui=web_ui,
                           thinking_token_budget=thinking_token_budget)
    options = dataclasses.replace(options, pooling=pooling)
    if ray is not None:
        return serve_on_ray(dataclasses.replace(options, threads=text.threads or 1), scaling, ray)
    server = build_server(options)  # bad input, failures: one line
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # uvicorn takes it over: a graceful stop, exit 0
    server.run()


def reranker_tokens(model, overrides: str | None):
    """A reranker's (negative, positive) classifier tokens: --hf-overrides' classifier_from_token,
    else ("no", "yes") for a checkpoint that is a reranker by its own files; None: a chat model."""
    from runtime.serve.rerank import CLASSIFIER_TOKENS, classifier_tokens, reranker_checkpoint

    tokens = classifier_tokens(overrides)
    if tokens is None and reranker_checkpoint(model):
        tokens = CLASSIFIER_TOKENS
        say("reranker: the checkpoint's README.md says it is one; /v1/rerank and /score score with 'no'/'yes' "
            "(--hf-overrides to choose the tokens)")
    return tokens


def embedding_pooling(model, pooling: str | None, normalize: bool | None):
    """An embedding model's pooling (runtime/embedding.py's Pooling): --pooling, or the
    checkpoint's sentence-transformers files; None: a generative model."""
    from runtime.embedding import resolve_pooling

    found = resolve_pooling(model, pooling, normalize)
    if found is not None:
        say(f"embeddings: {found.describe()}; /v1/embeddings serves the vectors")
    return found


def check_replicas(ray, replicas: int, least, most):
    """The replica options checked: Scaling (None without --ray, where they must be left)."""
    given = [f"--{name} {value}" for name, value in (("replicas", replicas if replicas != 1 else None),
                                                     ("min-replicas", least), ("max-replicas", most))
             if value is not None]
    if ray is None:
        if given:
            raise ValueError(f"{given[0]}: replicas need --ray (local, or a cluster's HOST:PORT)")
        return None
    positive("--replicas", replicas)
    if least is not None and least < 0:
        raise ValueError(f"--min-replicas {least}: expected 0 or more")
    if most is not None:
        positive("--max-replicas", most)
    if least is not None and most is not None and least > most:
        raise ValueError(f"--min-replicas {least} > --max-replicas {most}")
    from runtime.ray_cluster import check_ray_serve
    from runtime.serve.scaling import Scaling

    check_ray_serve(ray)
    return Scaling(replicas, least, most)


def serve_on_ray(options, scaling, address: str) -> None:
    """Build the artifacts into the cache once, then run the replicas on Ray Serve until
    SIGTERM or Ctrl-C (the application then deleted; a local cluster shut down)."""
    from runtime.serve.assemble import build_artifacts

    build_artifacts(options, say)
    from runtime.serve import ray_app

    ray_app.start(options, scaling, address, say)
    say(f"qwen3vl serve: {options.model_id} ready at http://{options.host}:{options.port}/v1 "
        f"({scaling.describe()} on Ray Serve)")
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stopped.set())
    while not stopped.wait(1):
        pass
    say("qwen3vl serve: stopping the replicas")
    ray_app.stop(address)


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


def build_server(options: ServeOptions):
    """Everything loaded (text module, vision module, weights), then a uvicorn server."""
    from runtime.serve.assemble import assemble
    from runtime.serve.server import GracefulServer

    url = f"http://{options.host}:{options.port}/v1"
    if options.web_ui:
        url += f" (chat page: http://{options.host}:{options.port}/)"
    app, engine, _ = assemble(options, say, on_ready=lambda: say(f"qwen3vl serve: {options.model_id} ready at {url}"))
    return GracefulServer(app, engine.cut, options.grace, host=options.host, port=options.port, log_level="warning")


def say(message: str) -> None:
    click.echo(message, err=True)
