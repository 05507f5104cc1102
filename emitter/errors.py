"""One-line errors and the exit statuses every command keeps.

A command ends in one of these ways:

- 0: done;
- 1 (`EXIT_FAILED`): the work itself failed, not the input (a compile, a Ray engine, a
  check that did not pass): raise a `Failure`;
- 2 (`EXIT_BAD_INPUT`): bad input or an unwritable output (ValueError, OSError), before
  anything is half-written;
- 130 (`EXIT_INTERRUPTED`, 128 + SIGINT): Ctrl-C; 143 (128 + SIGTERM): terminated.

Every failure is one line on stderr, `error: ...`; `command_errors` maps the exceptions
to it, so each command (and the `qwen3vl` group around them all) says it the same way.
"""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager
from typing import NoReturn

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 128 + signal.SIGINT


def one_line_error(e: BaseException) -> str:
    """An exception's message on one line (whitespace runs collapsed), else its type's name."""
    return " ".join(str(e).split()) or type(e).__name__


class Failure(RuntimeError):
    """The work failed, not the input: exit status 1. `one_line` is what a command prints."""

    def one_line(self) -> str:
        return one_line_error(self)


def fail(message: str, status: int = EXIT_BAD_INPUT) -> NoReturn:
    """One line on stderr, `error: message`, then exit `status`; no traceback."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    sys.exit(status)


@contextmanager
def command_errors():
    """Run a command's body: Ctrl-C, a `Failure`, and bad input (ValueError, OSError) each
    end it with one `error:` line and their exit status (module docstring)."""
    try:
        yield
    except KeyboardInterrupt:
        fail("interrupted (SIGINT)", EXIT_INTERRUPTED)
    except Failure as e:
        fail(e.one_line(), EXIT_FAILED)
    except (ValueError, OSError) as e:
        fail(one_line_error(e))
