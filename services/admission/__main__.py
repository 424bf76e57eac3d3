"""``python -m services.admission`` is ``tandem admission``."""

import sys

from services.cli import run_as_main

if __name__ == "__main__":
    sys.exit(run_as_main("admission"))
