"""``python -m services.up`` is ``tandem up``."""

import sys

from services.cli import run_as_main

if __name__ == "__main__":
    sys.exit(run_as_main("up"))
