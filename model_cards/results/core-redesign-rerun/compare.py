"""Compare the rows re-run after the core redesign (this folder) with the committed rows, per-query hits included.

Run from the repository root: python model_cards/results/core-redesign-rerun/compare.py"""
import json
from pathlib import Path

here = Path(__file__).parent
results = here.parent
new = [json.loads(line) for f in sorted(here.glob("rows-*.jsonl")) for line in f.read_text().splitlines()[1:]]
full = [json.loads(line) for line in (results / "v2-full-i2t" / "rows.jsonl").read_text().splitlines()[1:]]
i10 = json.loads((results / "v2-issue10" / "results.json").read_text())["rows"]
def find(rows, obj, shift, sev, seed):
    for r in rows:
        if r["objective"] == obj and r["shift"] == shift and r.get("severity") == sev and r["seed"] == seed and r.get("direction", "i2t") == "i2t":
            return r
for r in new:
    key = (r["objective"], r["shift"], r.get("severity"), r["seed"])
    ref = find(i10, *key) if "+" in r["objective"] else (find(full, *key) or find(i10, *key))
    if ref is None:
        print(key, "no committed row")
        continue
    same = ref["hits"] == r["hits"]
    print(key, "R@1 new", r["R@1"], "committed", ref["R@1"], "hits identical:", same, "safety", r.get("safety"), "domains", r.get("domains"))
