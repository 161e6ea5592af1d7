"""``python -m kvshare`` runs the CLI."""

import sys

from .cli import main

sys.exit(main())
