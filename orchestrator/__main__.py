"""``python -m orchestrator [flags]``: run the orchestrator (same as ``specsplit orchestrator``)."""

import sys

from specsplit.cli import main

sys.exit(main(["orchestrator", *sys.argv[1:]]))
