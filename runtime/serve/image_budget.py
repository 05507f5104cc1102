"""Per-request image budgets: vLLM's `mm_processor_kwargs` {min_pixels, max_pixels}, bounded by
the server's `--image-min-tokens` / `--image-max-tokens` (llama-server's flags).

An image of `pixels` becomes about `pixels / factor**2` tokens (`factor` = patch size x merge
size: 32 for Qwen3-VL), so the flags bound the pixel counts at `tokens * factor**2`. The
flags also bound the checkpoint's own budget for requests that give none. The budget is
the processor policy's `min_pixels`/`max_pixels` (smart_resize), so it decides the image's
pixels, its grid and its rows: the encoder cache (keyed by the processed pixels and grid)
and the prefix cache (keyed by the rows) tell two budgets apart by themselves. Images only;
videos keep the checkpoint's video policy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from runtime.serve.errors import ApiError

KEYS = ("min_pixels", "max_pixels")


@dataclass(frozen=True)
class ImageBudget:
    min_tokens: int | None = None  # --image-min-tokens
    max_tokens: int | None = None  # --image-max-tokens

    def bounds(self, policy) -> tuple[int, int]:
        """The pixel counts a request may ask for: the flags' token counts in pixels (or no bound)."""
        area = policy.factor ** 2
        low = self.min_tokens * area if self.min_tokens else 1
        high = self.max_tokens * area if self.max_tokens else None
        return low, high

    def default(self, policy):
        """The checkpoint's policy with its budget clamped into the flags' bounds."""
        if not (self.min_tokens or self.max_tokens):
            return policy
        low, high = self.bounds(policy)
        most = policy.max_pixels if high is None else min(policy.max_pixels, high)
        least = min(max(policy.min_pixels, low), most)
        return replace(policy, min_pixels=least, max_pixels=most)

    def for_request(self, body: dict, policy):
        """The images' policy for this request: its own budget, else the flags' default,
        else None (the checkpoint's policy, untouched: answers equal `generate`'s)."""
        own = self.policy(body, policy)
        if own is not None or not (self.min_tokens or self.max_tokens):
            return own
        return self.default(policy)

    def policy(self, body: dict, policy):
        """The images' processor policy for this request (`mm_processor_kwargs` checked), or
        None for the server's default (`default`)."""
        kwargs = body.get("mm_processor_kwargs")
        if kwargs is None:
            return None
        if not isinstance(kwargs, dict):
            raise ApiError("mm_processor_kwargs: expected an object {min_pixels, max_pixels}", "mm_processor_kwargs")
        for key in kwargs:
            if key not in KEYS:
                raise ApiError(f"mm_processor_kwargs.{key}: not supported (expected min_pixels, max_pixels)",
                               f"mm_processor_kwargs.{key}")
        base = self.default(policy)
        low, high = self.bounds(policy)
        values = {}
        for key in KEYS:
            value = kwargs.get(key)
            if value is None:
                continue
            param = f"mm_processor_kwargs.{key}"
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ApiError(f"{param}: {value!r}: expected a positive integer", param)
            if value < low or (high is not None and value > high):
                span = f"[{low}, {high}]" if high is not None else f">= {low}"
                raise ApiError(f"{param}: {value}: outside the server's bounds {span} pixels "
                               "(--image-min-tokens / --image-max-tokens)", param)
            values[key] = value
        least, most = values.get("min_pixels", base.min_pixels), values.get("max_pixels", base.max_pixels)
        if least > most:
            raise ApiError(f"mm_processor_kwargs: min_pixels {least} > max_pixels {most}", "mm_processor_kwargs")
        return replace(policy, min_pixels=least, max_pixels=most)
