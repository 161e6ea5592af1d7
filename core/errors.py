"""User-facing errors and how a command reports them.

Anything raised as :class:`KvshareError` is a user mistake or an environment problem
(missing file, wrong kind, unreachable registry). The CLI prints its message on one line
and exits non-zero; it never shows a traceback for it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


class KvshareError(Exception):
    """An error whose message is meant for the user, not a bug report."""


def exit_code(command: Callable[[], int]) -> int:
    """Run a command's body, reporting user mistakes (and unreadable or unwritable paths) as one
    ``kvshare: error:`` line with exit code 1, and Ctrl-C as exit code 130."""
    try:
        return command()
    except (KvshareError, OSError) as err:
        print(f"kvshare: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvshare: interrupted", file=sys.stderr)
        return 130
