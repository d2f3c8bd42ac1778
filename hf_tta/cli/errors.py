"""The CLI's user-error type, in a module of its own so that every CLI module can raise it without import cycles."""


class UsageError(ValueError):
    """A mistake in the command line: reported as one line naming the fix, exit status 2 (traceback with --debug)."""
