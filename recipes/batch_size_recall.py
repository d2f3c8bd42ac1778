"""Recall against the online batch size, with the window of recent queries for small batches (issue 27, item 3).

For each batch size (default 1, 4, 16, 64) this runs ``hf-tta run`` on the emoji benchmark (image→text, the default
corruptions, the given severities and seeds; rows ``tcr`` and ``recommended`` plus the source, which every grid has)
with ``--window 64 - B`` below 64 (:mod:`hf_tta.window`: the batch statistics cover the batch and the 64 - B queries
before it, so every statistic spans 64 queries as in the papers; 64 itself runs the papers' per-batch statistics). Each
batch size writes its own folder ``<output-dir>/bs<B>/`` with ``rows.jsonl`` (per-query hits, the runner's rows; an
interrupted run resumes there), then the summary table is printed and written to ``<output-dir>/summary.md``:
mean R@1 per row and batch size, the gain over the source, the share of the batch-64 gain reached at each batch size,
and the worst stream's difference to the source (the target: at batch 1 at least 80 % of the batch-64 gain, and never
below the source beyond the noise).

    python recipes/batch_size_recall.py --seeds 0,1,2 --output-dir outputs/batch-size-recall     # the full measurement
    python recipes/batch_size_recall.py --seeds 0 --limit 100 --corruptions defocus_blur --severities 3 --output-dir /tmp/bsr
    python recipes/batch_size_recall.py --summary-only --output-dir outputs/batch-size-recall  # the table from the rows
    python recipes/batch_size_recall.py --no-window --batch-sizes 1 --rows tcr --output-dir outputs/batch-size-recall
                                                            # the control: batch 1 without the window (bs1-w0)

Extra arguments after ``--`` go to every ``hf-tta run`` (e.g. ``-- --threads 2 --cache-dir ~/.cache/hf-tta``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROWS = ("tcr", "recommended")
SOURCE = "source"
FULL = 64


def window_for(b: int, no_window: bool = False) -> int:
    """The window a batch size runs with: 64 - B below 64 (0 for the ``--no-window`` control)."""
    return 0 if no_window or b >= FULL else FULL - b


def folder_for(b: int, window: int) -> str:
    """``bs<B>`` for the recipe's window, ``bs<B>-w<W>`` for another (the control)."""
    return f"bs{b}" if window == window_for(b) else f"bs{b}-w{window}"


def run_batch_size(b: int, args: argparse.Namespace, extra: list[str]) -> Path:
    """``hf-tta run`` at batch size ``b`` (with the window below 64, or none with ``--no-window``) into
    ``<output-dir>/bs<b>`` (``bs<b>-w0``); returns the folder."""
    window = window_for(b, args.no_window)
    out = Path(args.output_dir) / folder_for(b, window)
    cmd = [sys.executable, "-m", "hf_tta.cli", "run", "--objectives", ",".join(args.rows), "--direction", "i2t",
           "--corruptions", args.corruptions, "--severities", args.severities, "--seeds", args.seeds,
           "--batch-size", str(b), "--no-style", "--output-dir", str(out), "--no-plots", "--quiet"]
    if window:
        cmd += ["--window", str(window)]
    if args.limit is not None:
        cmd += ["--limit", str(args.limit)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd + extra, check=True, env=os.environ.copy())
    return out


def read_rows(folder: Path) -> list[dict]:
    """The finished rows of a run (``rows.jsonl``; its first line is the run's header)."""
    path = folder / "rows.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a torn last line of an interrupted run
            continue
        if "objective" in row and "error" not in row:
            rows.append(row)
    return rows


def _hits(row: dict) -> np.ndarray:
    return np.frombuffer(row["hits"].encode(), dtype=np.uint8).astype(np.float64) - 48


def _by_stream(items: list[dict]) -> dict[tuple, dict[str, dict[int, dict]]]:
    """``{(shift, severity): {objective: {seed: row}}}``; the runner's clean reference stream is not a shift."""
    acc: dict[tuple, dict[str, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    for r in items:
        if r["shift"] != "clean":
            acc[(r["shift"], r["severity"])][r["objective"]][r["seed"]] = r
    return acc


def _diffs(a: dict, b: dict, keys: list[tuple], row_a: str, row_b: str) -> list[np.ndarray]:
    """Per stream, ``(seeds, queries)`` hit differences of ``row_a`` in ``a`` minus ``row_b`` in ``b`` (the seeds both
    ran; the same seed's stream holds the same queries in the same order at every batch size)."""
    out = []
    for k in keys:
        seeds = sorted(set(a[k][row_a]) & set(b[k][row_b]))
        out.append(np.stack([_hits(a[k][row_a][s]) - _hits(b[k][row_b][s]) for s in seeds]))
    return out


def summarise(by_size: dict[tuple[int, int], list[dict]], rows: tuple[str, ...]) -> str:
    """The markdown table: per row and (batch size, window), mean R@1 (%) over streams and seeds; the gain over the source with
    its 95 % interval; the share of the batch-64 gain (ratio of the mean gains over the streams both batch sizes ran);
    the difference to the same row at batch 64 with its interval; and the worst stream's difference to the source with
    its interval and what it supports (``below`` only when the whole interval is below zero, else the detection limit).
    Intervals: :func:`hf_tta.benchmarks.intervals.paired_bootstrap` (items resampled jointly across the streams, seeds
    resampled)."""
    from hf_tta.benchmarks.intervals import below_source_claim, paired_bootstrap

    def ci(diffs: list[np.ndarray]) -> str:
        mean, (lo, hi) = paired_bootstrap(diffs)
        return f"{mean:+.1f} [{lo:+.1f}, {hi:+.1f}]"

    streams = {key: _by_stream(items) for key, items in by_size.items()}
    full = streams.get((FULL, 0), {})
    lines = ["| row | batch | window | R@1 | gain over source [95 % CI] | share of batch-64 gain | vs batch 64 [95 % CI] "
             "| worst stream vs source [95 % CI] | seconds/run |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in (SOURCE, *rows):
        for b, w in sorted(streams, key=lambda key: (key[0], -key[1])):
            st = streams[(b, w)]
            keys = sorted((k for k, d in st.items() if row in d and SOURCE in d), key=str)
            if not keys:
                continue
            r1 = float(np.mean([np.mean([r["R@1"] for r in st[k][row].values()]) for k in keys]))
            gain = share = versus = worst = "—"
            if row != SOURCE:
                diffs = _diffs(st, st, keys, row, SOURCE)
                gain = ci(diffs)
                per_stream = {k: float(np.mean(d)) * 100 for k, d in zip(keys, diffs)}
                stream = min(per_stream, key=per_stream.get)
                mean, bounds = paired_bootstrap(_diffs(st, st, [stream], row, SOURCE))
                worst = f"{mean:+.1f} [{bounds[0]:+.1f}, {bounds[1]:+.1f}] {stream[0]} {stream[1]}: {below_source_claim(mean, bounds)}"
                both = [k for k in keys if k in full and row in full[k] and SOURCE in full[k]]
                if (b, w) != (FULL, 0) and both:
                    gain_b = float(np.mean([d.mean() for d in _diffs(st, st, both, row, SOURCE)]))
                    gain_64 = float(np.mean([d.mean() for d in _diffs(full, full, both, row, SOURCE)]))
                    share = f"{100 * gain_b / gain_64:.0f} %" if abs(gain_64) > 1e-9 else "—"
                    versus = ci(_diffs(st, full, both, row, row))
            secs = [r["seconds"] for k in keys for r in st[k][row].values() if "seconds" in r]
            lines.append(f"| {row} | {b} | {w} | {r1:.1f} | {gain} | {share} | {versus} | "
                         f"{worst} | {sum(secs) / max(1, len(secs)):.1f} |")
    return "\n".join(lines)


def summary_of(folder: Path | str, rows: tuple[str, ...] = ROWS) -> str:
    """The table of the rows under ``folder/bs<B>[-w<W>]/rows.jsonl``, every batch size and window found (the card's
    block); each run's window is read from its ``rows.jsonl`` header."""
    found = {}
    for path in Path(folder).glob("bs*/rows.jsonl"):
        header = json.loads(path.read_text().split("\n", 1)[0]).get("hf-tta-run", {})
        found[(int(re.match(r"bs(\d+)", path.parent.name)[1]), int(header.get("window") or 0))] = read_rows(path.parent)
    return summarise({key: r for key, r in found.items() if r}, rows)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2", help="Comma list of seeds (stream order, corruptions, --limit slice).")
    p.add_argument("--batch-sizes", default="1,4,16,64", help="Comma list of online batch sizes.")
    p.add_argument("--severities", default="3,5", help="Image severities.")
    p.add_argument("--corruptions", default="default", help="Image corruptions (default: one per ImageNet-C family).")
    p.add_argument("--rows", default=",".join(ROWS), help="Rows besides the source model.")
    p.add_argument("--limit", type=int, default=None, help="A seeded slice of this many concepts (a quick check).")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--summary-only", action="store_true", help="Only summarise the rows already in --output-dir.")
    p.add_argument("--no-window", action="store_true",
                   help="The control: run the batch sizes without the window (into bs<B>-w0); the table shows both.")
    args = p.parse_args(argv)
    args.rows = tuple(r for r in args.rows.split(",") if r)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    if any(b < 1 or b > FULL for b in sizes):
        p.error(f"--batch-sizes must be in 1..{FULL}.")
    if not args.summary_only:
        for b in sizes:
            run_batch_size(b, args, extra)
    table = summary_of(args.output_dir, args.rows)
    print(table)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.output_dir) / "summary.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
