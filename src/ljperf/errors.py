"""Errors that ljperf turns into exit codes and one-line messages (see ``ljperf.cli.main``)."""

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_OOM = 3
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


class UsageError(Exception):
    """Bad input from the user: exit 2 with this one-line message, never a traceback."""


class RunFailed(Exception):
    """A run failed after starting; carries the exit code and a one-line reason."""

    def __init__(self, reason: str, *, exit_code: int = EXIT_ERROR):
        super().__init__(reason)
        self.exit_code = exit_code
