"""What load balancers, dashboards and operators poll: ``/health``, ``/metrics`` (Prometheus
text, :mod:`.metrics`) and ``/version``; open without the API key."""

from __future__ import annotations

from fastapi import Depends
from fastapi.responses import Response

from ... import __version__
from .errors import error_response
from .state import ServerState, get_state

async def health(state: ServerState = Depends(get_state)) -> dict | Response:
    """200 while the engine thread steps; 503 (a load balancer must stop sending here) when not."""
    problem = state.engine_thread.health()
    if problem is not None:
        return error_response(503, problem, kind="server_error")
    return {"status": "ok"}


async def metrics(state: ServerState = Depends(get_state)) -> Response:
    """Our ``kvshare_*`` metrics and vLLM's names beside them."""
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


async def version() -> dict:
    """The kvshare release serving."""
    return {"version": __version__}
