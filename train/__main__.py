"""``accelerate launch -m kvshare.train RECIPE.yaml [key=value ...] [--resume]``."""

import sys

from .cli import main

sys.exit(main())
