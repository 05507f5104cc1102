"""The Ray Data engine of `qwen3vl embed`: a Dataset over the image paths, `map_batches`
with a pool of actors, each holding one vision session opened from the cache the
driver filled (`embed.prepare`), so nothing is compiled per actor. Retrieval vectors
(runtime/jobs/retrieval.py) go through the same pool with their own actor.

Results come back to the driver in input order (`preserve_order`), one row per image:
its grid, its features as raw f32 bytes ([1 + K, tokens, out_hidden]) or its error.
A killed actor is restarted by Ray and its batch retried (Ray Data's defaults for actor
pools: unlimited restarts and task retries); the driver writes every shard, so a
retried batch cannot write anything twice.

Imported only when `--ray-local` or `--ray` is given: Ray is an optional dependency.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Iterator

import numpy as np

from runtime.jobs.embed_engine import Embedded, EngineError, SessionSpec, encode_batch
from runtime.ray_cluster import INSTALL_HINT, LOCAL_OBJECT_STORE, check_reachable, last_line


def check_ray(ray_local: int | None, address: str | None) -> None:
    """Fail before any work when the Ray options are wrong or Ray is not installed."""
    if ray_local is not None and address is not None:
        raise ValueError(f"--ray-local {ray_local} and --ray {address}: give one (a new local cluster, "
                         f"or the address of a running one)")
    if ray_local is not None and ray_local < 1:
        raise ValueError(f"--ray-local {ray_local}: expected 1 or more workers")
    flag = f"--ray-local {ray_local}" if ray_local is not None else f"--ray {address}"
    if address is not None:
        check_reachable(address)
    quiet()
    try:
        import ray.data  # noqa: F401
    except ImportError as e:
        raise ValueError(f"{flag}: needs Ray Data, which is not installed ({e}); {INSTALL_HINT}") from None


class Encoder:
    """One Ray actor: one session, opened once; a batch of paths -> one row per image."""

    def __init__(self, spec: SessionSpec):
        self.session = spec.open()

    def __call__(self, batch: dict) -> dict:
        results = encode_batch(self.session, [str(p) for p in batch["image"]])
        return {
            "image": np.array([r.image for r in results], dtype=object),
            "grid": np.array([r.grid or (0, 0, 0) for r in results], np.int64).reshape(-1, 3),
            "features": np.array([b"" if r.features is None else np.ascontiguousarray(r.features).tobytes()
                                  for r in results], dtype=object),
            "error": np.array([r.error or "" for r in results], dtype=object),
        }


def quiet() -> None:
    """Ray's own logging down to errors in this process (the bar and summary say what
    happens); the environment wins where it sets these."""
    os.environ.setdefault("RAY_DATA_LOG_LEVEL", "ERROR")  # read when ray.data is first imported


class RayEngine:
    """A Ray cluster joined (or started) for one embed job. `map(worker, spec, rows, batch)`
    runs rows (dicts) through an actor pool of `worker(spec)` (one actor per worker CPU,
    each with `threads` IREE threads, default 1) and yields the result rows in input order;
    `results(spec, images, batch)` is the vision tower's job (Embedded results)."""

    def __init__(self, threads: int | None, ray_local: int | None, address: str | None, say):
        import ray

        self.threads = threads or 1
        if ray_local is not None:
            say(f"ray: starting a local cluster with {ray_local} workers")
            ray.init(address="local", num_cpus=ray_local, object_store_memory=LOCAL_OBJECT_STORE,
                     include_dashboard=False, logging_level=logging.ERROR)  # a new cluster, never a running one
            cpus = ray_local
        else:
            say(f"ray: joining {address}")
            ray.init(address=address, logging_level=logging.ERROR)
            cpus = int(ray.cluster_resources().get("CPU", 1))
        self.actors = max(1, cpus // self.threads)
        self.fixed = ray_local is not None  # a local cluster is all ours: every actor at once

    def map(self, worker, spec, rows: list[dict], batch: int) -> Iterator[dict]:
        import ray
        import ray.data

        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False
        context.execution_options.preserve_order = True
        pool = (ray.data.ActorPoolStrategy(size=self.actors) if self.fixed
                else ray.data.ActorPoolStrategy(min_size=1, max_size=self.actors))
        dataset = ray.data.from_items(rows).map_batches(
            worker, batch_size=batch, compute=pool, num_cpus=self.threads, batch_format="numpy",
            fn_constructor_kwargs={"spec": dataclasses.replace(spec, threads=self.threads)})
        try:
            yield from dataset.iter_rows()
        except ray.exceptions.RayError as e:  # an actor that cannot start, a lost node...
            raise EngineError(f"ray: {last_line(e)}") from None

    def results(self, spec: SessionSpec, images: list[str], batch: int) -> Iterator[Embedded]:
        from runtime.artifact.build import make_plan

        cfg = make_plan(spec.model, None, spec.buckets, spec.target, precision=spec.precision).cfg
        for row in self.map(Encoder, spec, [{"image": image} for image in images], batch):
            yield _embedded(row, cfg)

    def close(self) -> None:
        import ray
        ray.shutdown()


def _embedded(row: dict, cfg) -> Embedded:
    """A result row back into an Embedded."""
    image, error = str(row["image"]), str(row["error"])
    if error:
        return Embedded(image, error=error)
    grid = tuple(int(v) for v in row["grid"])
    tokens = int(np.prod(grid)) // cfg.merge_unit
    features = np.frombuffer(row["features"], np.float32).reshape(1 + len(cfg.deepstack_visual_indexes), tokens,
                                                                  cfg.out_hidden_size)
    return Embedded(image, grid, features)
