"""``python -m lightning_nanguard report|validate ...`` (the same as the ``nanguard`` command)."""

import sys

from .report.cli import main

sys.exit(main())
