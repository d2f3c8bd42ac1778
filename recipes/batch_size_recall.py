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

Extra arguments after ``--`` go to every ``hf-tta run`` (e.g. ``-- --threads 2 --cache-dir ~/.cache/hf-tta``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROWS = ("tcr", "recommended")
SOURCE = "source"
FULL = 64


def run_batch_size(b: int, args: argparse.Namespace, extra: list[str]) -> Path:
    """``hf-tta run`` at batch size ``b`` (with the window below 64) into ``<output-dir>/bs<b>``; returns the folder."""
    out = Path(args.output_dir) / f"bs{b}"
    cmd = [sys.executable, "-m", "hf_tta.cli", "run", "--objectives", ",".join(args.rows), "--direction", "i2t",
           "--corruptions", args.corruptions, "--severities", args.severities, "--seeds", args.seeds,
           "--batch-size", str(b), "--no-style", "--output-dir", str(out), "--no-plots", "--quiet"]
    if b < FULL:
        cmd += ["--window", str(FULL - b)]
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


def summarise(by_size: dict[int, list[dict]], rows: tuple[str, ...]) -> str:
    """The markdown table: per row and batch size, mean R@1 (%) over streams and seeds; the gain over the source with
    its 95 % interval; the share of the batch-64 gain (ratio of the mean gains over the streams both batch sizes ran);
    the difference to the same row at batch 64 with its interval; and the worst stream's difference to the source with
    its interval and what it supports (``below`` only when the whole interval is below zero, else the detection limit).
    Intervals: :func:`hf_tta.benchmarks.intervals.paired_bootstrap` (items resampled jointly across the streams, seeds
    resampled)."""
    from hf_tta.benchmarks.intervals import below_source_claim, paired_bootstrap

    def ci(diffs: list[np.ndarray]) -> str:
        mean, (lo, hi) = paired_bootstrap(diffs)
        return f"{mean:+.1f} [{lo:+.1f}, {hi:+.1f}]"

    streams = {b: _by_stream(items) for b, items in by_size.items()}
    full = streams.get(FULL, {})
    lines = ["| row | batch | window | R@1 | gain over source [95 % CI] | share of batch-64 gain | vs batch 64 [95 % CI] "
             "| worst stream vs source [95 % CI] | seconds/run |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in (SOURCE, *rows):
        for b in sorted(streams):
            st = streams[b]
            keys = sorted((k for k, d in st.items() if row in d and SOURCE in d), key=str)
            if not keys:
                continue
            r1 = float(np.mean([np.mean([r["R@1"] for r in st[k][row].values()]) for k in keys]))
            gain = share = versus = worst = "—"
            if row != SOURCE:
                gain = ci(_diffs(st, st, keys, row, SOURCE))
                per_stream = {k: float(np.mean(d)) * 100 for k, d in zip(keys, _diffs(st, st, keys, row, SOURCE))}
                w = min(per_stream, key=per_stream.get)
                mean, bounds = paired_bootstrap(_diffs(st, st, [w], row, SOURCE))
                worst = f"{mean:+.1f} [{bounds[0]:+.1f}, {bounds[1]:+.1f}] {w[0]} {w[1]}: {below_source_claim(mean, bounds)}"
                both = [k for k in keys if k in full and row in full[k] and SOURCE in full[k]]
                if b != FULL and both:
                    gain_b = float(np.mean([d.mean() for d in _diffs(st, st, both, row, SOURCE)]))
                    gain_64 = float(np.mean([d.mean() for d in _diffs(full, full, both, row, SOURCE)]))
                    share = f"{100 * gain_b / gain_64:.0f} %" if abs(gain_64) > 1e-9 else "—"
                    versus = ci(_diffs(st, full, both, row, row))
            secs = [r["seconds"] for k in keys for r in st[k][row].values() if "seconds" in r]
            lines.append(f"| {row} | {b} | {FULL - b if b < FULL else 0} | {r1:.1f} | {gain} | {share} | {versus} | "
                         f"{worst} | {sum(secs) / max(1, len(secs)):.1f} |")
    return "\n".join(lines)


def summary_of(folder: Path | str, rows: tuple[str, ...] = ROWS) -> str:
    """The table of the rows under ``folder/bs<B>/rows.jsonl``, every batch size found (the card's block)."""
    found = {int(p.parent.name[2:]): read_rows(p.parent) for p in Path(folder).glob("bs*/rows.jsonl")}
    return summarise({b: r for b, r in sorted(found.items()) if r}, rows)


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
    args = p.parse_args(argv)
    args.rows = tuple(r for r in args.rows.split(",") if r)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    if any(b < 1 or b > FULL for b in sizes):
        p.error(f"--batch-sizes must be in 1..{FULL}.")
    by_size = {}
    for b in sizes:
        folder = Path(args.output_dir) / f"bs{b}"
        if not args.summary_only:
            run_batch_size(b, args, extra)
        by_size[b] = read_rows(folder)
    table = summarise({b: r for b, r in by_size.items() if r}, args.rows)
    print(table)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.output_dir) / "summary.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
