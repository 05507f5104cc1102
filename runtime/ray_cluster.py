"""What the Ray engines (`qwen3vl embed --ray`, `qwen3vl serve --ray`) share: the install
hint, a local cluster's object store, the address check and Ray's errors in one line."""

from __future__ import annotations

import os
import socket

INSTALL_HINT = "install the ray extra: pip install 'qwen3vl-iree[ray]' (in a checkout: pip install -e '.[ray]')"
LOCAL_OBJECT_STORE = 512 * 2**20  # a local cluster's: rows and requests pass through it
# Ray Serve's proxy ready and health checks, seconds: a proxy still starting on a busy
# host failed three 5 s checks and was killed before it ran.
PROXY_CHECKS = ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S")
PROXY_CHECK_S = 60.0


def check_reachable(address: str) -> None:
    """A HOST:PORT address must answer a TCP connect within 5 s (Ray itself retries for
    minutes); `auto` and `ray://` addresses are left to Ray."""
    host, _, port = address.rpartition(":")
    if address == "auto" or "://" in address or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise ValueError(f"--ray {address}: no Ray cluster answers there ({e.strerror or e}); expected the "
                         f"HOST:PORT that `ray start --head` printed") from None


def last_line(e: BaseException) -> str:
    """The reason Ray gives last (its messages carry the remote traceback first)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__


def check_ray_serve(address: str) -> None:
    """Fail before any work when the cluster is not reachable or Ray Serve is not installed."""
    if address != "local":
        check_reachable(address)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # read at import: each replica's "ready" line, not just the first
    for name in PROXY_CHECKS:  # a local cluster's processes inherit them; a busy 2-core host misses Serve's 5-10 s
        os.environ.setdefault(name, str(PROXY_CHECK_S))
    try:
        from ray import serve  # noqa: F401
    except ImportError as e:
        raise ValueError(f"--ray {address}: needs Ray Serve, which is not installed ({e}); {INSTALL_HINT}") from None
