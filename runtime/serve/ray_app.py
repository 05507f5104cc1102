"""`qwen3vl serve --ray`: the server as a Ray Serve application of two deployments.

- `Front`, the ingress (no model, no CPU reserved): every HTTP request through Ray
  Serve's proxy is read whole, given its `Route` (runtime/serve/affinity.py) and passed
  to a replica through a handle whose router is `CacheAffinityRouter`
  (runtime/serve/ray_router.py); the replica's answer comes back as it is made (a stream
  chunk by chunk).
- `Replica`, N of them (or autoscaled): each owns one engine and all its caches (the app
  of `qwen3vl serve`, runtime/serve/assemble.py, with its routes, errors and streaming),
  opened from the artifact cache the driver filled (`build_artifacts`): nothing is
  compiled per replica. Each answer carries `X-Qwen3VL-Replica: ID`; a request with that
  header goes to that replica while it lives (`GET /metrics` of one replica, say).

A replica that dies mid-request: its requests end with OpenAI's error object (503,
`replica_lost`; a stream: an error event, then `data: [DONE]`); the router sends new ones
to the others; Ray Serve starts a new replica in its place.

Imported only with `--ray`: Ray is an optional dependency.
"""

# No `from __future__ import annotations`: Ray Serve's ingress hands FastAPI the routes' annotations as they are.
import asyncio
import logging
import sys

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig

from runtime.serve.affinity import Route, routing_key
from runtime.serve.respond import sse
from runtime.serve.assemble import ServeOptions, assemble
from runtime.serve.errors import ApiError
from runtime.serve.scaling import Scaling

APP_NAME = "qwen3vl"
REPLICA_HEADER = "x-qwen3vl-replica"
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
QUIET = {"log_level": "WARNING", "enable_access_log": False}


def scope_of(request: Request) -> dict:
    """The parts of an ASGI HTTP scope a replica's app reads (the proxy's own are not
    serializable)."""
    s = request.scope
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": s.get("http_version", "1.1"),
            "method": s["method"], "scheme": s.get("scheme", "http"), "path": s["path"],
            "raw_path": s.get("raw_path") or s["path"].encode(), "query_string": s.get("query_string", b""),
            "root_path": "", "headers": list(s["headers"]), "client": s.get("client"), "server": s.get("server")}


def lost(e: BaseException) -> ApiError:
    return ApiError(f"the replica running this request was lost ({type(e).__name__}); retry", status=503,
                    code="replica_lost")


front = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000, logging_config=QUIET)
@serve.ingress(front)
class Front:
    def __init__(self, replicas):
        self.replicas = replicas

    @front.api_route("/{path:path}", methods=METHODS)
    async def forward(self, request: Request):
        import ray.exceptions

        body = await request.body()
        route = Route(routing_key(request.url.path, body) if request.method == "POST" else None,
                      request.headers.get(REPLICA_HEADER))
        answer = self.replicas.options(stream=True).remote(route, scope_of(request), body)
        try:
            head = await answer.__anext__()
        except ray.exceptions.RayError as e:
            answer.cancel()
            error = lost(e)
            return Response(error.json(), status_code=error.status, media_type="application/json")
        except BaseException:  # the client gone before the head: the replica's request cancelled
            answer.cancel()
            raise
        status, headers = head
        response_headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers
                            if k.lower() not in (b"content-length", b"transfer-encoding")}
        streamed = response_headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(self.rest(answer, streamed), status_code=status, headers=response_headers)

    @staticmethod
    async def rest(answer, streamed: bool):
        """The body's chunks as the replica sends them; a replica lost midway ends a stream
        with an error event and [DONE]; a client gone cancels the replica's request."""
        import ray.exceptions

        try:
            async for chunk in answer:
                yield chunk
        except ray.exceptions.RayError as e:
            if streamed:
                yield (sse(lost(e).body()) + "data: [DONE]\n\n").encode()
        finally:
            answer.cancel()


class Replica:
    """One engine and its app, loaded from the cache; `__call__` runs one HTTP request
    through the app and yields (status, headers), then the body's chunks."""

    def __init__(self, options: ServeOptions):
        self.app, self.engine, self.metrics = assemble(options, say)
        self.name = serve.get_replica_context().replica_id.unique_id
        say(f"replica {self.name} ready")

    async def __call__(self, route: Route, scope: dict, body: bytes):
        """`route` is for the router (it chose this replica by it); the request is `scope`
        and `body`."""
        sent, messages = asyncio.Event(), asyncio.Queue()

        async def receive():
            if not sent.is_set():
                sent.set()
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client's end is seen by the front: it cancels this

        task = asyncio.ensure_future(self.app(scope, receive, messages.put))
        try:
            while True:
                message = await messages.get()
                if message["type"] == "http.response.start":
                    yield message["status"], [*message.get("headers", []), (REPLICA_HEADER.encode(),
                                                                             self.name.encode())]
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        break
            await task
        finally:
            task.cancel()

    def record_routing_stats(self) -> dict:
        """What a router may read of this replica (Ray Serve polls it): the /metrics gauges
        of its queue, its running sequences and its KV cache, under their /metrics names."""
        return self.metrics.load()

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def application(options: ServeOptions, scaling: Scaling):
    """The bound application: the front over the replicas of these options."""
    router = RequestRouterConfig(request_router_class="runtime.serve.ray_router.CacheAffinityRouter",
                                 request_router_kwargs={"lanes": options.max_batch},
                                 request_routing_stats_period_s=2)
    replica = serve.deployment(Replica, name="Replica", max_ongoing_requests=options.max_batch + options.max_waiting,
                               ray_actor_options={"num_cpus": options.threads}, request_router_config=router,
                               graceful_shutdown_timeout_s=options.grace,
                               logging_config=QUIET, **scaling.deployment_options(options.max_batch))
    return Front.bind(replica.bind(options))


def start(options: ServeOptions, scaling: Scaling, address: str, say=say) -> None:
    """Join (`address`) or start (`local`) a Ray cluster and run the application on it,
    its HTTP proxy at the options' host and port; returns once every replica is ready."""
    import ray

    from runtime.ray_cluster import LOCAL_OBJECT_STORE

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the driver's "ready" line says it
    if address == "local":
        say(f"ray: starting a local cluster with {scaling.peak * options.threads} CPUs")
        ray.init(address="local", num_cpus=scaling.peak * options.threads, object_store_memory=LOCAL_OBJECT_STORE,
                 include_dashboard=False, logging_level=logging.ERROR)
    else:
        say(f"ray: joining {address}")
        ray.init(address=address, logging_level=logging.ERROR)
    serve.start(http_options={"host": options.host, "port": options.port}, logging_config=QUIET)
    serve.run(application(options, scaling), name=APP_NAME, route_prefix="/")


def stop(address: str) -> None:
    """The application deleted (a cluster of ours: Serve and Ray shut down)."""
    import ray

    if address == "local":
        serve.shutdown()
    else:
        serve.delete(APP_NAME)
    ray.shutdown()
