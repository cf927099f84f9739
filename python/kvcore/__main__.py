"""``python -m kvcore``: the ``kvcore`` command."""

import sys

from kvcore.entrypoints.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
