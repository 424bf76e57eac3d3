"""The CLI's user-facing error (its own module so `python -m services.cli` sees one class)."""


class CliError(Exception):
    """A user-facing error: printed as one line on stderr, no traceback; exit code 2 (bad settings
    or input) unless the command documents its own for this cause."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code
