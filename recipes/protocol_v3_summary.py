#!/usr/bin/env python
"""Choices and tables of protocol v3 (``recipes/protocol_v3.py``) from its rows alone."""

from __future__ import annotations

import json
from pathlib import Path


def load(out: Path | list[Path], direction: str | None = None) -> list[dict]:
    """Every finished run's row under ``out/<phase>/<direction>/<config>/rows.jsonl``, tagged with its phase and
    config; or the rows of an exported ``rows.jsonl`` (already tagged)."""
    if isinstance(out, (list, tuple)):
        return [r for o in out for r in load(o, direction)]
    out = Path(out)
    if out.is_file():
        rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    else:
        rows = []
        for path in sorted(out.glob("*/*/*/rows.jsonl")):
            phase, config = path.parts[-4], path.parts[-2]
            for line in path.read_text().splitlines()[1:]:
                row = json.loads(line)
                if "error" not in row:
                    rows.append({**row, "phase": phase, "config": config})
    return [r for r in rows if direction is None or r["direction"] == direction]
