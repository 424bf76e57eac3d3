"""``python -m loadtest.tools.replay``: see the package's docstring (and ``--help``)."""

from loadtest.tools.replay.cli import main

raise SystemExit(main())
