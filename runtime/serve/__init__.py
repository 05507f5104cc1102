"""`qwen3vl serve`: an OpenAI-compatible chat server on IREE.

- `app`: the HTTP side (FastAPI): routes, OpenAI's shapes, SSE streaming, auth, errors.
- `protocol`: the request body checked into a `ChatRequest`.
- `media`: image_url / video_url to files (data: URLs; file:// under an allowed folder).
- `scheduler`: the engine thread that runs requests on the model.
- `encoder_cache`: the tower's rows of media already seen (LRU in bytes).
- `metrics`: Prometheus metrics.

The `qwen3vl serve` command itself is runtime/commands/serve.py.
"""
