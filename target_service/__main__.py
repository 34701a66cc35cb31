"""``python -m target_service [flags]``: run the target service (same as ``specsplit target``)."""

import sys

from specsplit.cli import main

sys.exit(main(["target", *sys.argv[1:]]))
