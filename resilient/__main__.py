"""``python -m resilient``: the same command line as the ``resilient`` script."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
