"""The CLI's user-facing error (its own module so `python -m services.cli` sees one class)."""


class CliError(Exception):
    """A user-facing error: printed as one line on stderr, exit code 2, no traceback."""
