"""``python -m services.kv_index`` is ``tandem kv-index``."""

import sys

from services.cli import run_as_main

if __name__ == "__main__":
    sys.exit(run_as_main("kv-index"))
