"""`qwen3vl serve`: an OpenAI-compatible chat server on IREE.

- `app`: the HTTP side (FastAPI): routes, OpenAI's shapes, SSE streaming, errors.
- `guard`: the pure ASGI middleware before the routes: Host check, API key, Content-Type,
  and the catch-all that answers any crash with OpenAI's error object.
- `body`: the request body read as JSON within bounds (size, nesting, valid text).
- `errors`: OpenAI's error object; `shown`, how a request's value is echoed.
- `protocol`: the request body checked into a `ChatRequest`.
- `media`: image_url / video_url to files (data: URLs; file:// under an allowed folder).
- `agents`: tools, tool_choice, structured output and chat_template_kwargs checked.
- `answer`: the answer's text into the message (reasoning, content, tool calls), whole or streamed.
- `tools`, `reasoning`: the tool-call formats of Qwen's templates; the <think> split.
- `structured`: llguidance grammars and the per-sequence token masks.
- `endpoints`: /v1/models/{id}, /v1/completions, /tokenize, /detokenize.
- `respond`: what chat and completions share: a job's events to its client, whole or as
  SSE, the job cancelled when the client leaves.
- `image_budget`: mm_processor_kwargs within --image-min-tokens / --image-max-tokens.
- `scheduler`: the engine thread that runs requests on the model.
- `encoder_cache`: the tower's rows of media already seen (LRU in bytes).
- `metrics`: Prometheus metrics.
- `server`: uvicorn's server with a shutdown that answers every request past `--grace`.
- `assemble`: one server's parts from its options (generator, engine, metrics, app).
- `ray_app`, `ray_router`, `affinity`, `scaling`: `--ray`, the server as replicas on Ray Serve,
  requests routed by the start of their prompt to the replica whose cache holds it.

The `qwen3vl serve` command itself is runtime/commands/serve.py.
"""
