#!/usr/bin/env python
"""Issue 29's study: what adapting more of the query tower than its LayerNorms can win back, supervised (prequential
ceilings per parameter set) and label-free (TCR on those sets with the options of :mod:`hf_tta.tuning`), chosen on one
split and reported on another. Every run is an ``hf-tta run`` (so its rows carry per-query hits); this script only
names the configs, runs them (``--jobs`` processes of one thread each; interrupted phases resume) and summarises.

Parameter sets of the emoji benchmark's ConvNeXt image tower (i2t). ConvNeXt has no attention: its token mixer is a
depth-wise convolution, which PEFT's LoRA cannot wrap below rank = channels, so "LoRA on attention" has no analogue here.

* ``ln``: the 15 LayerNorms (every seed's methods); ``stem``: the patch-embedding convolution and its LayerNorm;
  ``ln+stem``: both; ``bitfit``: every bias of the tower; ``lora4-mlp`` / ``lora16-mlp``: LoRA of rank 4 / 16 on
  the 20 MLP layers (``pwconv1``/``pwconv2``); ``all``: every parameter of the tower (the ``oracle_all`` row).

Phases (the split is fixed here, before any run):

1. ``ceilings``: the prequential oracle (``oracle`` row: each batch scored, then trained on its true captions) on each
   set at lr 1e-4, 3e-4, 1e-3. **Selection split**: seed 0, the noise and blur families (Gaussian, shot, impulse,
   speckle noise at severity 5; defocus, glass, motion, zoom blur at severities 3 and 5), a seeded slice of 500
   concepts (``--limit 500``). Each set's lr: the one with the highest share of lost recall won back (ratio of sums).
2. ``candidates``: label-free rows, each with and without the safety layer, on the same selection split; every one
   tried is recorded. The rule: the highest won-back share among rows with no column more than 1.0 R@1 (5 of 500
   queries) below the source. From round 3 on, ``streams`` adds the selection seed's clean, degenerate, diverse and
   switching streams (``--limit 500``) to the candidates' rows, and the rule walks the eligible rows from the highest
   share down, taking the first whose streams are none more than 1.0 below the source (a row whose streams have not
   run stops the walk: run them).
3. ``report``: the chosen candidate (with and without the safety layer) next to TCR on the LayerNorms, at the
   paper's lr and at the lr their ceiling chose (:data:`LR_CONTROL`, from round 2 on), and the prequential ceilings
   of the LayerNorms and of the candidate's set, each at the lr its set chose in phase 1.
   **Held-out split**: seeds 1 and 2, all 1,899 queries, the weather family (snow, frost, fog, brightness) and
   contrast at severities 3 and 5, elastic, pixelate and JPEG at severity 5 (label-free rows only: the source keeps
   93 % or more there); plus, for the candidate, the clean, Noto-style, diverse and switching streams and a
   degenerate stream of 50 constant batches (the diverse and switching streams joined in the second round).

The text tower's study (``--direction t2i``, :data:`T2I_SETS`; choose on the character-level text corruptions, report
on the word-level ones with all 1,899 queries, text severities 3 and 7) runs the same phases, streams included, into
its own ``--out``.

    python recipes/beyond_ln.py ceilings --out runs/beyond-ln --jobs 2
    python recipes/beyond_ln.py candidates --out runs/beyond-ln --jobs 2
    python recipes/beyond_ln.py streams --out runs/beyond-ln --jobs 2 --only <the top rows' names>/
    python recipes/beyond_ln.py report --out runs/beyond-ln --jobs 2 --candidate <name from candidates>
    python recipes/beyond_ln.py summary --out runs/beyond-ln > summary.md
    python recipes/beyond_ln.py report --out runs/round2 --prior model_cards/results/beyond-ln/rows.jsonl \\
        --candidate tcr-ln-lr3e-3 --only tcr-ln-lr3e-3      # a later round next to the exported rows
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hf_tta.benchmarks.protocols.v3 import (
    run_folder,  # (its runner: one thread, offline, command and log in the folder)
)

NORMS = r"vision_model\.(embeddings\.layernorm|encoder\.stages\.\d+\.(layers\.\d+\.layernorm|downsampling_layer\.0)|layernorm)"
STEM = r"vision_model\.embeddings\.(patch_embeddings|layernorm)"
LN_STEM = rf"({NORMS}|vision_model\.embeddings\.patch_embeddings)"
MLP = r".*vision_model.*pwconv[12]"
LN_MLP = rf"({NORMS}|{MLP})"

SETS: dict[str, list[str]] = {  # hf-tta run arguments of each parameter set (the oracle row adapts them)
    "ln": [],
    "stem": ["--target_modules", STEM],
    "ln+stem": ["--target_modules", LN_STEM],
    "bitfit": ["--tuning", "bias"],
    "lora4-mlp": ["--tuning", "lora", "--lora_rank", "4", "--target_modules", MLP],
    "lora16-mlp": ["--tuning", "lora", "--lora_rank", "16", "--target_modules", MLP],
}
LRS = ("1e-4", "3e-4", "1e-3", "3e-3")  # 3e-3 added after 1e-3 won for three sets (the grid's edge)

CANDIDATES: dict[str, list[str]] = {  # label-free: TCR (its paper defaults) on more of the tower
    "tcr-ln": [],
    "tcr-stem": SETS["stem"],
    "tcr-ln+stem": SETS["ln+stem"],
    # the ceilings moved the stem furthest at 3 x the LayerNorms' lr: the same per-group lr, label-free
    "tcr-ln+stem-x3": [*SETS["ln+stem"], "--lr_multipliers", json.dumps({"patch_embeddings": 3.0})],
    "tcr-ln+stem-anchor": [*SETS["ln+stem"], "--anchor_weight", "1.0"],
    "tcr-ln+stem+gd": [*SETS["ln+stem"], "--gradient-decoupling", "tcr"],
    "tcr-bitfit": SETS["bitfit"],
    "tcr-lora4-mlp": SETS["lora4-mlp"],
    "tcr-ln+mlp-x0.03": ["--target_modules", LN_MLP, "--lr_multipliers", json.dumps({"pwconv": 0.03})],
    "tcr-ln+mlp-x0.03-anchor": ["--target_modules", LN_MLP, "--lr_multipliers", json.dumps({"pwconv": 0.03}),
                                "--anchor_weight", "1.0"],
    # controls added after the first report (the LayerNorm ceiling moved from 6 % at lr 3e-4 to 38 % at 3e-3): is
    # the chosen candidate's gain the stem's, or only a higher learning rate's? TCR on the LayerNorms alone, at the
    # lrs the ceilings chose; they compete under the same rule on the same selection split
    "tcr-ln-lr1e-3": ["--lr", "1e-3"],
    "tcr-ln-lr3e-3": ["--lr", "3e-3"],
}
# Round 3 (added after round 2's report had been read, so post hoc; chosen under the round-3 rule of the summary, which
# adds the seed-0 streams to the selection split). Two answers to what round 2 found limits the candidate:
# * the safety layer's drift rule reads the stem's large useful changes as harm and rolls them back: ``-lite`` keeps
#   its degenerate-batch and collapse rules and turns the drift rule off (one row, ``tcr+safe``);
# * unsafe, the candidate ends below the source on clean and JPEG queries: ``-consist`` adds the pull towards the
#   source's top-5 predictions (``consistency_weight``; weights 1 and 10 fixed before any run, 0.1 and 0.01 after them).
LITE = ["--objectives", "tcr+safe", "--safety", json.dumps({"min_agreement": 0.0, "max_agreement_drop": 1.0})]
X3 = CANDIDATES["tcr-ln+stem-x3"]
CANDIDATES |= {
    "tcr-ln+stem-x3-lite": [*X3, *LITE],
    "tcr-ln-lr3e-3-lite": ["--lr", "3e-3", *LITE],
    "tcr-ln+stem-x3-consist1": [*X3, "--consistency_weight", "1.0"],
    "tcr-ln+stem-x3-consist10": [*X3, "--consistency_weight", "10.0"],
    # weights 1 and 10 held the model at the source (0.6 % and 0.3 % won back): two lower weights, same split
    "tcr-ln+stem-x3-consist0.1": [*X3, "--consistency_weight", "0.1"],
    "tcr-ln+stem-x3-consist0.01": [*X3, "--consistency_weight", "0.01"],
}

CANDIDATE_SET = {  # the parameter set each candidate adapts (whose ceiling the report shows next to it)
    "tcr-ln": "ln", "tcr-ln-lr1e-3": "ln", "tcr-ln-lr3e-3": "ln", "tcr-stem": "stem", "tcr-bitfit": "bitfit", "tcr-lora4-mlp": "lora4-mlp",
    **{name: "ln+stem" for name in CANDIDATES if name.startswith("tcr-ln+stem")},
    **{name: "all" for name in CANDIDATES if name.startswith("tcr-ln+mlp")},  # no ceiling of its own: the nearest above
    "tcr-ln-lr3e-3-lite": "ln",
}

SELECTION = [
    ["--corruptions", "gaussian_noise,shot_noise,impulse_noise,speckle_noise", "--severities", "5"],
    ["--corruptions", "defocus_blur,glass_blur,motion_blur,zoom_blur", "--severities", "3,5"],
]
SELECTION_COMMON = ["--seeds", "0", "--limit", "500", "--no-style"]
HELD_OUT = [
    ["--corruptions", "snow,frost,fog,brightness,contrast", "--severities", "3,5"],
    ["--corruptions", "elastic_transform,pixelate,jpeg_compression", "--severities", "5"],
]
REPORT_COMMON = ["--seeds", "1,2", "--no-style"]
STREAMS_ARGS = ["--clean", "--degenerate", "--degenerate-batches", "50", "--diverse", "--switch"]

# ---- text->image: the same study on the MiniLM text tower (6 BERT layers; fixed here before any t2i run) ----------
# Sets: its 13 LayerNorms (the t2i default), every bias, LoRA of rank 4 / 16 on attention's query and value (the
# usual LoRA targets) and on the MLPs (intermediate.dense / output.dense), the embedding block (position and
# token-type embeddings and its LayerNorm: the word table's 11.7 M entries are left out), LayerNorms + embeddings,
# and every parameter. lr grid: 3e-5 (the text tower's default) up to 1e-3.
T_NORMS = r"text_model\.(embeddings\.LayerNorm|encoder\.layer\.\d+\.(attention\.output|output)\.LayerNorm)"
T_EMB = r"text_model\.embeddings\.(position_embeddings|token_type_embeddings|LayerNorm)"
T_ATTN = r".*text_model.*attention\.self\.(query|value)"
T_MLP = r".*text_model.*(intermediate|layer\.\d+\.output)\.dense"
T2I_SETS: dict[str, list[str]] = {
    "ln": [],
    "emb": ["--target_modules", T_EMB],
    "ln+emb": ["--target_modules", rf"({T_NORMS}|{T_EMB})"],
    "bitfit": ["--tuning", "bias"],
    "lora4-attn": ["--tuning", "lora", "--lora_rank", "4", "--target_modules", T_ATTN],
    "lora16-attn": ["--tuning", "lora", "--lora_rank", "16", "--target_modules", T_ATTN],
    "lora4-mlp": ["--tuning", "lora", "--lora_rank", "4", "--target_modules", T_MLP],
}
# 3e-3 and 1e-2 added after 1e-3 won for six of the eight sets (the grid's edge), run for those six only (``--only``)
T2I_LRS = ("3e-5", "1e-4", "3e-4", "1e-3", "3e-3", "1e-2")
# The candidates, fixed after the ceilings (selection split) and before any t2i candidate ran: TCR at the text tower's
# default lr (3e-5) on the LayerNorms, and on each set at the lr its ceiling chose (round 1 of the image tower's study
# showed that the lr moves the gain as much as the set does), with the LayerNorms at those lrs as the lr controls.
T2I_CANDIDATES: dict[str, list[str]] = {
    "tcr-ln": [],
    "tcr-ln-lr3e-4": ["--lr", "3e-4"],
    "tcr-ln-lr1e-3": ["--lr", "1e-3"],
    "tcr-ln+emb-lr1e-3": [*T2I_SETS["ln+emb"], "--lr", "1e-3"],
    "tcr-bitfit-lr3e-4": [*T2I_SETS["bitfit"], "--lr", "3e-4"],
    "tcr-lora16-attn-lr1e-3": [*T2I_SETS["lora16-attn"], "--lr", "1e-3"],
    "tcr-lora4-attn-lr3e-3": [*T2I_SETS["lora4-attn"], "--lr", "3e-3"],
    "tcr-lora4-mlp-lr1e-3": [*T2I_SETS["lora4-mlp"], "--lr", "1e-3"],
    "tcr-lora16-attn-lr1e-3-consist1": [*T2I_SETS["lora16-attn"], "--lr", "1e-3", "--consistency_weight", "1.0"],
}
T2I_CANDIDATE_SET = {name: next(s for s in ("ln+emb", "bitfit", "lora16-attn", "lora4-attn", "lora4-mlp", "ln")
                                if name.startswith(f"tcr-{s}")) for name in T2I_CANDIDATES}
# Split: choose on the character-level family, report on the word-level family (the offline text corruptions; the
# sentence-level ones need checkpoints that are not here), each at text severities 3 and 7.
T2I_SELECTION = [["--text-corruptions", "ocr,char_insert,char_replace,char_swap,char_delete", "--text-severities", "3,7"]]
T2I_HELD_OUT = [["--text-corruptions", "synonym_replacement,random_insertion,random_swap,random_deletion,insert_punctuation",
                 "--text-severities", "3,7"]]
T2I = ["--direction", "t2i"]

STUDIES = {  # direction -> (sets, lrs, candidates, candidate's set, selection, held-out, extra arguments)
    "i2t": (SETS, LRS, CANDIDATES, CANDIDATE_SET, SELECTION, HELD_OUT, []),
    "t2i": (T2I_SETS, T2I_LRS, T2I_CANDIDATES, T2I_CANDIDATE_SET, T2I_SELECTION, T2I_HELD_OUT, T2I),
}


#: The report's lr control per direction: TCR on the LayerNorms alone at the lr the LayerNorm ceiling chose (round 2 of
#: the image tower's study showed that most of a deeper set's label-free gain can be that lr's).
LR_CONTROL = {"i2t": "tcr-ln-lr3e-3", "t2i": "tcr-ln-lr1e-3"}


def _jobs(phase: str, candidate: str | None = None, lrs: dict[str, str] | None = None,
          direction: str = "i2t") -> list[tuple[str, list[str]]]:
    """The phase's runs: (folder, `hf-tta run` arguments). ``lrs``: each set's chosen lr (report)."""
    sets, grid, candidates, candidate_set, selection, held_out, extra_args = STUDIES[direction]
    no_corruptions = ["--corruptions", ""] if direction == "i2t" else ["--text-corruptions", ""]
    jobs: list[tuple[str, list[str]]] = []
    if phase == "ceilings":
        for name, extra in [*sets.items(), ("all", None)]:
            row = ["--objectives", "oracle", *extra] if extra is not None else ["--objectives", "oracle_all"]
            for lr in grid:
                for i, split in enumerate(selection):
                    jobs.append((f"oracle-{name}-lr{lr}/part{i}", [*extra_args, *row, "--lr", lr, *split, *SELECTION_COMMON]))
    elif phase == "candidates":
        for name, extra in candidates.items():
            for i, split in enumerate(selection):
                jobs.append((f"{name}/part{i}", [*extra_args, "--objectives", "tcr,tcr+safe", *extra, *split, *SELECTION_COMMON]))
    elif phase == "streams":  # the selection seed's streams, kept with the candidates' rows (the round-3 rule)
        for name, extra in candidates.items():
            jobs.append((f"{name}/streams", [*extra_args, "--objectives", "tcr,tcr+safe", *extra, *no_corruptions, *STREAMS_ARGS,
                                             *SELECTION_COMMON]))
    elif phase == "report":
        if candidate not in candidates:
            raise SystemExit(f"report needs --candidate, one of {list(candidates)} (the candidates phase's choice).")
        label_free = {"tcr-ln": "tcr", LR_CONTROL[direction]: "tcr", candidate: "tcr,tcr+safe"}  # the candidate last
        for name, rows in label_free.items():  # label-free rows: every held-out column
            for i, split in enumerate(held_out):
                jobs.append((f"{name}/part{i}", [*extra_args, "--objectives", rows, *candidates[name], *split, *REPORT_COMMON]))
        jobs.append((f"{candidate}/streams", [*extra_args, "--objectives", "tcr,tcr+safe", *candidates[candidate], *no_corruptions,
                                              *STREAMS_ARGS, *REPORT_COMMON[:2]]))
        # the ceilings of the LayerNorms and of the candidate's set (at the lr each chose on the selection split) on
        # the columns where the source keeps recall to lose: i2t weather and contrast (digital keeps 93 % or more)
        for set_name in dict.fromkeys(["ln", candidate_set[candidate]]):
            lr = lrs[set_name]
            row = ["--objectives", "oracle", *sets[set_name]] if set_name in sets else ["--objectives", "oracle_all"]
            jobs.append((f"oracle-{set_name}-lr{lr}/part0", [*extra_args, *row, "--lr", lr, *held_out[0], *REPORT_COMMON]))
    return jobs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("phase", choices=["ceilings", "candidates", "streams", "report", "summary"])
    parser.add_argument("--out", default="runs/beyond-ln")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/hf_tta/emoji-streams"))
    parser.add_argument("--candidate")
    parser.add_argument("--direction", choices=sorted(STUDIES), default="i2t",
                        help="i2t: the image tower's study; t2i: the text tower's (use another --out)")
    parser.add_argument("--only", nargs="+", help="run only the jobs whose name contains one of these")
    parser.add_argument("--prior", type=Path, nargs="*", default=[],
                        help="earlier rounds' exported rows.jsonl, read with --out's runs for the report's lr choices")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.phase == "summary":
        from beyond_ln_summary import summarise  # noqa: PLC0415 (next to this file)

        print(summarise([out, *args.prior], args.direction))
        return
    lrs = None
    if args.phase == "report":  # each set's lr, as the ceilings phase chose it on the selection split
        from beyond_ln_summary import choose_lrs, load  # noqa: PLC0415 (next to this file)

        lrs = {name.removeprefix("oracle-"): v["lr"] for name, v in choose_lrs(load([out, *args.prior], args.direction)).items()}
    jobs = [(n, a) for n, a in _jobs(args.phase, args.candidate, lrs, args.direction) if not args.only or any(o in n for o in args.only)]
    with ThreadPoolExecutor(args.jobs) as pool:
        folder = out / ("candidates" if args.phase == "streams" else args.phase)
        codes = list(pool.map(lambda job: run_folder(folder / job[0], job[1], args.cache_dir), jobs))
    failed = [n for (n, _), c in zip(jobs, codes) if c != 0]
    print(f"{len(jobs) - len(failed)} of {len(jobs)} runs finished" + (f"; failed: {failed}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
