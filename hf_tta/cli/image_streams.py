"""The emoji benchmark's robustness image streams on the command line: ``--switch`` and ``--stream-corruptions`` (the
corruptions the diverse and switching image streams draw from), refused in one line where they would not apply."""

from __future__ import annotations

from .common import UsageError


def check_image_stream_flags(args, emoji: bool, diverse: bool, directions) -> None:
    """Refuse ``--switch`` off the emoji benchmark, and ``--stream-corruptions`` without an image stream it sets (the
    emoji benchmark's diverse or switching stream of image queries): it would change nothing."""
    if args.switch and not emoji:
        raise UsageError("--switch runs on the emoji benchmark only; leave it out with --model (--degenerate works there).")
    if args.stream_corruptions and not (emoji and (args.switch or diverse) and "i2t" in directions):
        raise UsageError("--stream-corruptions sets the emoji benchmark's diverse and switching image streams: add --diverse "
                         "or --switch with --direction i2t (and no --model), or leave it out.")
