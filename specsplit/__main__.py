"""``python -m specsplit``: the same as the ``specsplit`` console command."""

import sys

from specsplit.cli import main

sys.exit(main())
