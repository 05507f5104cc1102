"""Ray Serve's request router for the replicas of `qwen3vl serve --ray`: cache-affine,
falling back to the least loaded.

A request's `Route` (runtime/serve/affinity.py) is the first argument the ingress passes.
A key seen before goes to the replica that ran it first (its home), while that replica
lives and has a free decode lane (fewer ongoing requests than `lanes`); a new key, a
request without one, or a home that is busy or gone: the least loaded replica (Ray
Serve's own choice among the candidates by their queue lengths). A new key's home is the
replica it was first sent to. Homes are kept per router (per ingress process), the
`keys` most recently used.
"""

from __future__ import annotations

import random
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from runtime.serve.affinity import Route


class CacheAffinityRouter(RequestRouter):
    def initialize_state(self, lanes: int = 4, keys: int = 65536):
        self.lanes, self.keys = lanes, keys
        self.homes: OrderedDict[str, str] = OrderedDict()  # key -> replica unique id

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        route = route_of(pending_request)
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        candidate_replicas = random.sample(candidate_replicas, len(candidate_replicas))  # ties: any of them
        if route.replica in by_name:
            return [[by_name[route.replica]]]
        home = by_name.get(self.homes.get(route.key)) if route.key else None
        if home is not None and self.free(home):
            self.homes.move_to_end(route.key)
            return [[home], candidate_replicas]
        return [candidate_replicas]

    def free(self, replica: RunningReplica) -> bool:
        ongoing = self.replica_queue_len_cache.get(replica.replica_id)
        return ongoing is None or ongoing < self.lanes

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        key = route_of(pending_request).key
        if key is None or self.homes.get(key) in {r.unique_id for r in self.curr_replicas}:
            return  # a busy home spilled to another replica stays the home
        self.homes[key] = replica_id.unique_id
        while len(self.homes) > self.keys:
            self.homes.popitem(last=False)


def route_of(pending_request: PendingRequest | None) -> Route:
    args = pending_request.args if pending_request is not None else ()
    return args[0] if args and isinstance(args[0], Route) else Route()
