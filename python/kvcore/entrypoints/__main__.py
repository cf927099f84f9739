"""``python -m kvcore.entrypoints serve ...`` / ``... bench serve ...``: the same as ``kvcore``."""

import sys

from kvcore.cli import main

sys.exit(main())
