"""One server's parts from its options: the generator (text and vision modules, weights),
the engine, the metrics and the FastAPI app. `qwen3vl serve` runs the app under uvicorn;
each Ray Serve replica (runtime/serve/ray_app.py) runs one in its own process."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServeOptions:
    """What `qwen3vl serve`'s options say about one engine and its HTTP side."""
    model: str
    context: int
    buckets: tuple
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 4
    precision: str = "f32"
    api_key: str | None = None
    allowed_local_media: str | None = None
    cache_dir: str | None = None
    threads: int | None = None
    target: str | None = None
    max_waiting: int = 16
    max_media: int = 8
    max_body_mb: int = 32
    encoder_cache_mb: int = 512
    prompt_cache: bool = True
    grace: float = 10.0
    kv_cache_dtype: str = "f32"
    kv_cache_memory: float | None = None
    allowed_hosts: tuple = ()
    image_tokens: tuple = (None, None)
    classifier_tokens: tuple | None = None  # a reranker's (negative, positive) tokens: --hf-overrides, or detected
    web_ui: bool = True  # the chat page at / (--no-web-ui: off)
    pooling: object = None  # runtime/embedding.py's Pooling: an embedding model (/v1/embeddings), else None
    thinking_token_budget: int | None = None  # a request's default reasoning budget (--thinking-token-budget)

    @property
    def model_id(self) -> str:
        return Path(self.model).resolve().name


def generator_for(options: ServeOptions, say):
    """The Generator of these options (nothing compiled or loaded yet)."""
    from runtime.generator import Generator
    from runtime.sizing import kv_blocks, weight_bytes

    blocks, note = kv_blocks(options.model, options.buckets, options.context, options.max_batch,
                             options.kv_cache_dtype, options.kv_cache_memory,
                             weight_bytes(options.model, options.precision, options.target))
    say(f"KV cache: {note}")
    return Generator(options.model, options.buckets, options.context, target=options.target,
                     cache_dir=options.cache_dir, precision=options.precision, threads=options.threads, progress=say,
                     kv_cache_dtype=options.kv_cache_dtype, lanes=options.max_batch, kv_blocks=blocks,
                     prefix_cache=options.prompt_cache, pooling=options.pooling)


def build_artifacts(options: ServeOptions, say) -> None:
    """The text and vision modules and their weight archives built into the cache (or found
    there), none loaded: what a Ray driver does once before its replicas open them."""
    from runtime.artifact.build import build_artifact

    generator = generator_for(options, say)
    generator.text.build()
    vision = generator.vision
    build_artifact(vision.plan, vision.cache, say)


def assemble(options: ServeOptions, say, on_ready=None):
    """(app, engine): everything loaded (text module, vision module, weights) and the
    engine thread started; the app's lifespan stops the engine."""
    from runtime.serve.app import Limits, create_app
    from runtime.serve.encoder_cache import EncoderCache
    from runtime.serve.guard import allowed_hosts as host_names
    from runtime.serve.image_budget import ImageBudget
    from runtime.serve.metrics import Metrics
    from runtime.serve.rerank import Classifier
    from runtime.serve.embeddings import start_pooled
    from runtime.serve.scheduler import Engine

    generator = generator_for(options, say)
    reranker = Classifier.of(generator.tokenizer, options.classifier_tokens) if options.classifier_tokens else None
    generator.text.module  # noqa: B018 - compiled and loaded now, not at the first request
    generator.vision.artifact()
    metrics = Metrics()
    encoder = EncoderCache(lambda: generator.vision, options.encoder_cache_mb << 20, metrics)
    engine = Engine(generator, metrics, encoder, options.max_waiting, start_pooled)
    limits = Limits(options.api_key, options.allowed_local_media, options.max_body_mb << 20, options.max_media,
                    allowed_hosts=host_names(options.host, options.port, options.allowed_hosts),
                    image_budget=ImageBudget(*options.image_tokens), reranker=reranker,
                    web_ui=options.web_ui, thinking_token_budget=options.thinking_token_budget)
    app = create_app(generator, engine, metrics, options.model_id, limits, on_ready=on_ready)
    return app, engine, metrics
