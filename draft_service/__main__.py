"""``python -m draft_service [flags]``: run the draft service (same as ``specsplit draft``)."""

import sys

from specsplit.cli import main

sys.exit(main(["draft", *sys.argv[1:]]))
