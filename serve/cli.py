"""``kvshare serve``: the OpenAI-compatible server, registered by the serve subsystem."""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import KvshareError
from .config import add_engine_arguments, add_server_arguments, engine_config_from_args, server_limits_from_args


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        from .server import serve
    except ImportError as err:
        raise KvshareError(f"the server needs its extra: pip install 'kvshare[server]' ({err})") from None
    api_key = args.api_key or os.environ.get("KVSHARE_API_KEY") or None  # env: not visible in ps
    if not api_key and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"kvshare: warning: serving on {args.host} without an API key: anyone who can reach "
              "the port can use it (set KVSHARE_API_KEY or --api-key)", file=sys.stderr)
    serve(args.model, args.adapter or [], host=args.host, port=args.port, api_key=api_key,
          config=engine_config_from_args(args), limits=server_limits_from_args(args))
    return 0


def register(sub) -> None:
    """Add ``kvshare serve``."""
    p = sub.add_parser("serve", help="OpenAI-compatible server for a base and its adapters",
                       description="Serve the base and exported adapters over an OpenAI-compatible "
                       "HTTP API (/v1/models, /v1/completions, /v1/chat/completions, /health, "
                       "/metrics). The request's model field picks the base or an adapter.")
    p.add_argument("--model", required=True, metavar="NAME_OR_DIR", help="zoo name or local model folder")
    p.add_argument("--adapter", action="append", metavar="DIR", help="exported adapter folder (repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (or set KVSHARE_API_KEY, "
                   "which other users cannot read from the process list)")
    add_engine_arguments(p)
    add_server_arguments(p)
    p.set_defaults(func=_cmd_serve)

