"""User-facing errors.

Anything raised as :class:`KvshareError` is a user mistake or an environment problem
(missing file, wrong kind, unreachable registry). The CLI prints its message on one line
and exits non-zero; it never shows a traceback for it.
"""


class KvshareError(Exception):
    """An error whose message is meant for the user, not a bug report."""
