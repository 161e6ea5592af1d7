"""What steps the engines: one thread over one or several co-located engines.

- :mod:`.colocation`: ``Colocation`` (engines by served name, stepped in turn by one thread,
  so two forwards never run at once) and ``colocate()`` / ``build_colocation()``;
- :mod:`.engine_thread`: ``AsyncEngine``, a Colocation stepped on its own thread, which the
  server, the Ray replicas and in-process workflows talk to;
- :mod:`.lending`: SwiftCache's lending policy between co-located engines (reclaim,
  scale-up, scale-down), over engines seen only through the ``Lender`` protocol;
- :mod:`.lender`: one engine's side of lending (``EngineLender``) and the shared arena.
"""

from .colocation import Colocation, colocate

__all__ = ["Colocation", "colocate"]
