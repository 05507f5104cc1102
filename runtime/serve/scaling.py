"""How many replicas `qwen3vl serve --ray` runs, as Ray Serve's deployment options."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scaling:
    """A fixed count of replicas, or autoscaled between `least` and `most` (Ray Serve's
    autoscaling_config; its target: `--max-batch` ongoing requests a replica, every decode
    lane busy). `replicas` is then the count it starts with."""
    replicas: int = 1
    least: int | None = None
    most: int | None = None

    @property
    def autoscaled(self) -> bool:
        return self.least is not None or self.most is not None

    @property
    def bounds(self) -> tuple[int, int]:
        least = self.least if self.least is not None else min(1, self.replicas)
        return least, max(self.most or self.replicas, least)

    @property
    def peak(self) -> int:
        """The most replicas there may be at once."""
        return self.bounds[1] if self.autoscaled else self.replicas

    def deployment_options(self, max_batch: int) -> dict:
        if not self.autoscaled:
            return {"num_replicas": self.replicas}
        least, most = self.bounds
        return {"num_replicas": "auto", "autoscaling_config": {
            "min_replicas": least, "max_replicas": most, "initial_replicas": min(max(self.replicas, least), most),
            "target_ongoing_requests": max_batch}}

    def describe(self) -> str:
        if not self.autoscaled:
            return f"{self.replicas} replica{'s' if self.replicas != 1 else ''}"
        least, most = self.bounds
        return f"{least} to {most} replicas, autoscaled"
