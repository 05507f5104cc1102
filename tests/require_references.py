"""A pytest plugin (loaded by conftest.py): under `make test` (QWEN3VL_REQUIRE_REFERENCES=1)
a skipped test is a failed one, unless its reason is on `ALLOWED_SKIPS`, so that the
suite cannot quietly shrink when an import, a fixture or a tool goes missing."""

from __future__ import annotations

import os

import pytest

# Skip reasons accepted under QWEN3VL_REQUIRE_REFERENCES=1 (a part of the reason -> why):
# each names something the machine lacks, never something the install lacks.
ALLOWED_SKIPS = {
    "mounting a small tmpfs needs root": "the full-disk and read-only cases mount a tmpfs, which only root can",
    "cannot mount a tmpfs here": "a container without CAP_SYS_ADMIN cannot mount one, root or not",
    "needs unprivileged user and mount namespaces": "`unshare -rm` is refused where the kernel or a sandbox "
                                                    "turns user namespaces off",
    "this machine has a CUDA device": "the missing-driver message can only be seen where the driver is missing",
    "are Linux": "PR_SET_PDEATHSIG and /proc exist on Linux only",
    "reads /proc/self/status": "Linux only",
    "finds iree-compile in /proc": "Linux only",
    "the mmap threshold is glibc's": "glibc only",
}


def required() -> bool:
    return os.environ.get("QWEN3VL_REQUIRE_REFERENCES") == "1"


def skip_reason(report) -> str:
    """The reason a skipped report gives (pytest keeps it as (path, line, "Skipped: ..."))."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip that `ALLOWED_SKIPS` does not name becomes a failure saying so (xfail is kept)."""
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and required()) or hasattr(report, "wasxfail"):
        return
    reason = skip_reason(report)
    if not any(allowed in reason for allowed in ALLOWED_SKIPS):
        report.outcome = "failed"
        report.longrepr = (f"skipped under QWEN3VL_REQUIRE_REFERENCES=1: {reason}\n"
                           f"make it run (install what it needs), or add its reason to ALLOWED_SKIPS in "
                           f"tests/require_references.py with why the machine may lack it")
