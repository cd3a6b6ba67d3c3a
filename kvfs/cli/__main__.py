"""`python -m kvfs.cli`: how the tests and the background daemon start kvfs."""

from __future__ import annotations

import sys

from . import main

sys.exit(main())
