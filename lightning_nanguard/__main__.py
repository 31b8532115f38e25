"""``python -m lightning_nanguard report|validate ...`` (the same as the ``nanguard`` command)."""

import sys

from .cli import main

sys.exit(main())
