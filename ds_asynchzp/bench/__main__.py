"""``python -m ds_asynchzp.bench``: same as the ``asynchzp-bench`` command."""

import sys

from .cli import main

sys.exit(main())
