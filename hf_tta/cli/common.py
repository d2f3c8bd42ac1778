"""What every CLI module shares without import cycles: the user-error type and the comma-list option type."""


class UsageError(ValueError):
    """A mistake in the command line: reported as one line naming the fix, exit status 2 (traceback with --debug)."""


def comma_list(value: str) -> list[str]:
    """The non-empty items of a comma list, stripped."""
    return [v.strip() for v in value.split(",") if v.strip()]
