"""``python -m services.prefill`` is ``tandem prefill``."""

import sys

from services.cli import run_as_main

if __name__ == "__main__":
    sys.exit(run_as_main("prefill"))
