"""Protocol v3 (:mod:`hf_tta.benchmarks.protocols.v3` and its ``v3_*`` modules): the choice rules and tables by hand,
the phases' runs, split runs and their merge."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from hf_tta.benchmarks.protocols import v3 as v3_recipe
from hf_tta.benchmarks.protocols import v3_rows, v3_summary


# ------------------------------------------------------------------------------------------------ protocol v3
def _v3_row(objective, shift, severity, n_hits, lr=3e-4, phase="select", config="c", n=400, seed=0, **extra):
    return {"direction": "i2t", "shift": shift, "severity": severity, "objective": objective, "seed": seed,
            "hits": "1" * n_hits + "0" * (n - n_hits), "phase": phase, "config": config, "lr": lr, **extra}


@pytest.fixture(scope="module")
def v3():
    return v3_summary


@pytest.fixture
def v3_selection(v3, monkeypatch):
    """Two selection columns (the split's are patched for a small case). Source: clean 400/400, Gaussian blur 5 200/400 (50 R@1), spatter 5 300/400 (75): 75 R@1 points lost.
    TCR at 1e-4 / 3e-4 / 1e-3 gains 5 / 17.5 / 32.5 points (shares 6.7 / 23.3 / 43.3 %); at 1e-3 its clean stream
    loses 10 of 400 queries (below the source by the margin)."""
    monkeypatch.setattr(v3, "selection_columns", lambda direction: [("gaussian_blur", 5), ("spatter", 5)])
    rows = [_v3_row("source", "clean", None, 400), _v3_row("source", "gaussian_blur", 5, 200),
            _v3_row("source", "spatter", 5, 300), _v3_row("source", "degenerate", None, 400, phase="degenerate")]
    for lr, blur, spatter, clean in ((1e-4, 220, 300, 400), (3e-4, 260, 310, 400), (1e-3, 300, 330, 390)):
        rows += [_v3_row("tcr", "gaussian_blur", 5, blur, lr), _v3_row("tcr", "spatter", 5, spatter, lr),
                 _v3_row("tcr", "clean", None, clean, lr)]
    for lr, blur in ((1e-4, 240), (1e-3, 280)):  # the ceiling: 15 % / 35 %, nothing else needed
        rows += [_v3_row("oracle", "gaussian_blur", 5, blur, lr), _v3_row("oracle", "spatter", 5, 305, lr)]
    return rows


def test_v3_shares_and_the_lr_rule_by_hand(v3, v3_selection):
    table = v3.selection_table(v3_selection, "i2t")
    assert [round(table["tcr"][lr]["share"], 6) for lr in (1e-4, 3e-4, 1e-3)] == [round(5 / 75, 6), round(17.5 / 75, 6), round(32.5 / 75, 6)]
    assert table["tcr"][1e-3]["clean"].below and not table["tcr"][3e-4]["clean"].below
    # the degenerate stream of the two best clean-passing lrs (3e-4, then 1e-4) is needed before the choice
    assert v3.choices(v3_selection, "i2t")["tcr"] == {"lr": None, "flags": ["degenerate stream pending"], "walk": [3e-4, 1e-4]}
    assert v3.degenerate_walk(v3_selection, "i2t") == [("tcr", "3e-4"), ("tcr", "1e-4")]
    with pytest.raises(SystemExit, match="degenerate phase"):
        v3.selected_lrs(v3_selection, "i2t")
    # the ceiling needs no stream: the highest share, at the grid's edge here
    assert v3.choices(v3_selection, "i2t")["oracle"] == {"lr": 1e-3, "flags": ["at the grid's edge"], "walk": []}


@pytest.mark.parametrize(
    ("degenerate", "lr", "flags"),
    [({3e-4: 400}, 3e-4, []),  # the best passes: no need to wait for the second
     ({3e-4: 380, 1e-4: 400}, 1e-4, ["at the grid's edge"]),  # the best collapses: the next passing one
     ({3e-4: 380, 1e-4: 380}, 3e-4, ["degenerate below the source at its best lrs"])],
)
def test_v3_the_degenerate_walk(v3, v3_selection, degenerate, lr, flags):
    rows = v3_selection + [_v3_row("tcr", "degenerate", None, h, k, phase="degenerate") for k, h in degenerate.items()]
    assert v3.choices(rows, "i2t")["tcr"] == {"lr": lr, "flags": flags, "walk": []}
    if lr == 1e-4:
        assert v3.edge_lrs(rows, "i2t")["tcr"] == "3e-5"
        assert "| tcr | **6.7 %** | 23.3 % | 43.3 % | 1e-4 |" in "\n".join(v3.selection_lines(rows, "i2t"))


def test_v3_preset_rule_prefers_the_simpler_within_the_tie(v3, v3_selection):
    rows = [r for r in v3_selection if r["objective"] == "source"]
    for row, lr, blur, degenerate in (("tcr+dn+safe", 3e-4, 282, 400), ("tcr+dn+safe", 1e-3, 283, 400),
                                      ("rest+dn+safe", 1e-3, 330, 390)):
        rows += [_v3_row(row, "gaussian_blur", 5, blur, lr, "preset"), _v3_row(row, "spatter", 5, 300, lr, "preset"),
                 _v3_row(row, "clean", None, 400, lr, "preset"), _v3_row(row, "degenerate", None, degenerate, lr, "preset")]
    cands = v3.preset_candidates(rows, "i2t")
    assert not cands["rest+dn+safe@1e-3"]["eligible"]  # its degenerate stream is below the source
    assert cands["tcr+dn+safe@1e-3"]["share"] - cands["tcr+dn+safe@3e-4"]["share"] == pytest.approx(0.25 / 75)
    chosen = v3.selected_preset(rows, "i2t")  # 1e-3 is better by 0.3 points of share: a tie, the paper's lr wins
    assert chosen["label"] == "tcr+dn+safe@3e-4" and chosen["args"] == ["--lr", "3e-4"]


def test_v3_proxy_study_by_hand(v3, v3_selection):
    """TCR's three lrs have shares 6.7 / 23.3 / 43.3 %; a gap proxy falling with the share ranks them exactly
    (ρ = +1, no regret); uniformity peaking at the middle lr picks it and loses 43.3 − 23.3 = 20 points of share."""
    gap = {1e-4: 0.5, 3e-4: 0.4, 1e-3: 0.3}
    uni = {1e-4: 0.1, 3e-4: 0.9, 1e-3: 0.5}
    rows = [{**r, "gap_after": gap[r["lr"]], "uniformity_after": uni[r["lr"]]} for r in v3_selection]
    got = v3.proxy_study(rows, "i2t")["tcr"]
    assert got["gap"]["rho"] == pytest.approx(1.0) and got["gap"]["regret"] == 0 and got["gap"]["proxy_lr"] == 1e-3
    assert got["uniformity"]["rho"] == pytest.approx(0.5) and got["uniformity"]["regret"] == pytest.approx(0.20)
    assert v3.spearman(np.array([1.0, 1.0, 2.0]), np.array([3.0, 2.0, 1.0])) == pytest.approx(-np.sqrt(3) / 2)


def test_v3_after_phase_scores_the_selected_lrs_after_the_update(v3, monkeypatch, tmp_path):
    """The papers' secondary column: Tent, TCR and REST at their selected lrs, seed 3, after-update scoring, the
    report's default grid; every other argument as the report's own run."""
    recipe = v3_recipe
    monkeypatch.setattr(v3, "load", lambda out: [])
    monkeypatch.setattr(v3, "selected_lrs", lambda rows, direction: {"tent": "1e-3", "tcr": "1e-2", "rest": "3e-3"})
    jobs = dict(recipe.jobs("after", "i2t", tmp_path))
    assert list(jobs) == ["after/i2t/tent-lr1e-3", "after/i2t/tcr-lr1e-2", "after/i2t/rest-lr3e-3"]
    args = jobs["after/i2t/tcr-lr1e-2"]
    value = lambda flag: args[args.index(flag) + 1]  # noqa: E731
    assert (value("--scoring"), value("--seeds"), value("--corruptions"), value("--lr")) == ("after_update", "3", "default", "1e-2")
    assert args.count("--scoring") == 1 and "before_update" not in args


def test_v3_after_update_column_by_hand(v3):
    """Source: clean 400/400, contrast 1 200/400 (seed 3, the report split); TCR at 1e-2 answers 300 before the
    update (share 100/200 = 50 %) and 320 after it (60 %): after − before = +5.0 R@1, its interval around it."""
    rep = dict(seed=3, lr=1e-2)
    rows = [_v3_row("source", "clean", None, 400, phase="report", seed=3), _v3_row("source", "contrast", 1, 200, phase="report", seed=3),
            _v3_row("tcr", "contrast", 1, 300, phase="report", **rep), _v3_row("tcr", "clean", None, 400, phase="report", **rep),
            _v3_row("source", "contrast", 1, 200, phase="after", seed=3), _v3_row("tcr", "contrast", 1, 320, phase="after", **rep)]
    # a column the report gained after the after-update runs (the text report's WordNet columns): left out, counted
    rows_later = [*rows, _v3_row("source", "fog", 5, 100, phase="report", seed=3), _v3_row("tcr", "fog", 5, 400, phase="report", **rep)]
    lines = v3.after_lines(rows_later, "i2t")
    assert len(lines) == 3 and lines[0].startswith("| row (1 column) |") and lines[2].startswith("| tcr@1e-2 | 50.0 % | 60.0 % | +5.0 [")
    lo, hi = (float(x.replace("−", "-")) for x in lines[2].split("[")[1].rstrip(" |]").split(", "))
    assert 0 < lo < 5.0 < hi and v3.after_lines(rows, "i2t")[2] == lines[2]
    with pytest.raises(ValueError, match="selection"):  # the report refuses the selection split's rows
        v3.after_lines([*rows, _v3_row("tcr", "spatter", 5, 300, phase="after", **rep)], "i2t")


def test_v3_auto_probe_against_the_labelled_choice_by_hand(v3, v3_selection):
    """The labelled choice: TCR at 3e-4 (23.3 %; 1e-3 fails the clean stream). The probe's run: Gaussian blur at 1e-3
    (280/400), spatter at 3e-4 (320/400): share (80 + 20) / 300 = 33.3 %, 142.9 % of the labelled. Proxies, from the
    fixed-lr rows: next_loss (1e-3, 3e-4) gives (100 + 10) / 300 = 36.7 % (157.1 %), agreement (1e-4, 1e-4) 20 / 300 =
    6.7 % (28.6 %). Passes: 3 streams of 400 queries, 128 probed each at 16 forwards and 15 backwards, S = 3:
    (3 · 400 · 7 − 3 · 128 · 7 + 3 · 128 · 31) / (3 · 400 · 7) = 2.10×."""
    rows = [*v3_selection, *(_v3_row("tcr", "degenerate", None, 400, lr, phase="degenerate") for lr in (1e-4, 3e-4))]

    def auto(shift, severity, n_hits, chosen, next_loss, agreement):
        search = {"chosen": chosen, "lr": chosen, "choices": {"next_loss": next_loss, "agreement": agreement},
                  "queries": 128, "forward": 128 * 16, "backward": 128 * 15}
        return _v3_row("tcr", shift, severity, n_hits, None, phase="auto", lr_search=search, num_queries=400, steps=3,
                       config="tcr-auto")

    rows += [auto("gaussian_blur", 5, 280, 1e-3, 1e-3, 1e-4), auto("spatter", 5, 320, 3e-4, 3e-4, 1e-4),
             auto("clean", None, 400, 3e-4, 3e-4, 1e-4)]
    lines = v3.auto_lines(rows, "i2t")
    assert lines[0].split(" | ")[5:7] == ["agreement: share (of labelled)", "next_loss: share (of labelled)"]
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:2] == ["tcr@auto", "3e-4 (23.3 %)"] and cells[2] == "G.blur: 1e-3, Spatter: 3e-4, Clean: 3e-4"
    assert cells[3] == "33.3 % (142.9 %)" and cells[4].startswith("not below the source (bound +0.0") and cells[4].endswith("not run")
    assert cells[5:] == ["6.7 % (28.6 %)", "36.7 % (157.1 %)", "2.10×"]


def test_v3_auto_on_the_report_split_by_hand(v3, v3_selection):
    """Labelled TCR lr 3e-4 (the selection fixture; also the paper's). Report, seed 3, contrast 1: source 200/400,
    TCR at 3e-4 300/400 (share 100/200 = 50 %), the probe 290/400 (45 %, 90 % of the labelled), with 5.5 forwards and
    4.5 backwards a query where a fixed lr at 3 steps a batch makes 4 + 3: 10 / 7 = 1.43×."""
    rows = [*v3_selection, *(_v3_row("tcr", "degenerate", None, 400, lr, phase="degenerate") for lr in (1e-4, 3e-4))]
    search = {"chosen": 3e-3, "lr": 3e-3, "choices": {}, "queries": 128, "forward": 0, "backward": 0}
    rows += [_v3_row("source", "clean", None, 400, phase="report", seed=3), _v3_row("source", "contrast", 1, 200, phase="report", seed=3),
             _v3_row("tcr", "contrast", 1, 300, 3e-4, phase="report", seed=3),
             _v3_row("source", "contrast", 1, 200, phase="auto", seed=3),
             _v3_row("tcr", "contrast", 1, 290, None, phase="auto", seed=3, lr_search=search, config="tcr-auto-report",
                     forward_per_query=5.5, backward_per_query=4.5, steps=3, num_queries=400),
             _v3_row("tcr", "contrast", 1, 250, None, phase="auto", seed=3, config="tcr-auto+hg0.1-report",
                     lr_search={**search, "lr": 1.7e-3, "lr_min": 1e-4, "lr_max": 3e-3})]
    # a column the report gained after the selectors ran (the text report's WordNet columns): left out of this table
    rows += [_v3_row("source", "fog", 5, 100, phase="report", seed=3), _v3_row("tcr", "fog", 5, 400, 3e-4, phase="report", seed=3)]
    lines = v3.auto_report_lines(rows, "i2t")
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:7] == ["tcr@auto", "1", "Contr. 1: 3e-3", "45.0 %", "3e-4: 50.0 %", "90.0 %", "50.0 %"]
    assert cells[7].startswith("not below the source") and cells[8] == "5.50, 4.50 (1.43×)"
    cells = [c.strip() for c in lines[3].strip("|").split("|")]  # the probe then the online rule: its lr at the end
    assert cells[:6] == ["tcr@auto+hg0.1", "1", "Contr. 1: 2e-3", "25.0 %", "3e-4: 50.0 %", "50.0 %"]
    assert cells[8] == "–"  # a row from before the cost columns
    assert len(v3.auto_report_lines(rows, "i2t", seeds=(3, 4, 5))) == 2  # no selector ran on every seed: no row
    # the probe's runs gain the new column (fog 5: 300/400), the other selector's do not: each on its own columns
    rows += [_v3_row("source", "fog", 5, 100, phase="auto", seed=3, config="tcr-auto-report~fog"),
             _v3_row("tcr", "fog", 5, 300, None, phase="auto", seed=3, lr_search=search, config="tcr-auto-report~fog")]
    lines = v3.auto_report_lines(rows, "i2t")
    assert [c.strip() for c in lines[2].strip("|").split("|")][:7] == ["tcr@auto", "2", "Contr. 1: 3e-3, Fog 5: 3e-3", "58.0 %",
                                                                       "3e-4: 80.0 %", "72.5 %", "80.0 %"]
    assert [c.strip() for c in lines[3].strip("|").split("|")][:2] == ["tcr@auto+hg0.1", "1"]


def test_v3_auto_phase_runs_every_selector_on_the_selection_split_first(v3, tmp_path):
    """Issue 37's selectors (the probe; the hypergradient rule alone at rates 0.02 and 0.1; the probe then the rule; the
    probe serving its leader, alone and under the safety layer; the back-off alone under the safety layer),
    for TCR and REST: every selection-split run (corruptions and clean, then degenerate) before any report run; each
    run's --lr_search parses into its LRSearchConfig, and its folder names the selector its rows are labelled by."""
    import json

    from hf_tta.lr_search import LRSearchConfig

    recipe, rows = v3_recipe, v3_rows
    jobs = recipe.jobs("auto", "i2t", tmp_path)
    names = [name for name, _ in jobs]
    assert len(names) == 3 * 7 * 2 and all("-report" not in n for n in names[:28]) and all(n.endswith("-report") for n in names[28:])
    for name, args in jobs:
        config = LRSearchConfig(**json.loads(args[args.index("--lr_search") + 1]))
        objective = name.split("/")[-1].split("-")[0]
        selector = rows.selector({"objective": objective, "config": name.split("/")[-1]})
        assert selector in recipe.SELECTORS and (config.online is None) == ("hg" not in selector)
        assert config.probe_batches == (4 if selector.startswith("auto") else 0) and "--lr" not in args
        assert config.hypergradient_rate == (0.1 if selector.endswith("hg0.1") else None)
        assert config.backoff == (0.5 if selector.startswith("backoff") else None)
        assert ("--safety" in args) == selector.endswith("+safe")
        assert config.serve == ("leader" if selector.startswith("auto+leader") else "source")


def test_v3_the_selector_chosen_on_the_selection_split_and_its_report_runs(v3, v3_selection, monkeypatch, tmp_path):
    """Per objective, the selector with the highest selection share whose clean and degenerate streams pass: here the
    probe (share 100 / 300 queries lost) loses 20 of 400 degenerate queries (below the source), so the back-off
    (50 / 300) is chosen;
    REST, whose only selector fails its clean stream, gets none. The auto phase then runs the chosen one on the
    report's seeds 4 and 5 and on its streams (seeds 3, 4, 5); their rows carry the selector's label."""
    search = {"chosen": 1e-3, "lr": 1e-3, "choices": {}, "queries": 128, "forward": 0, "backward": 0}
    rows = list(v3_selection)
    for config, blur, spatter, clean, degenerate in (("tcr-auto", 290, 310, 400, 380), ("tcr-backoff0.5+safe", 250, 300, 400, 400),
                                                     ("rest-auto", 300, 340, 390, 400)):
        objective = config.split("-")[0]
        for shift, severity, n_hits, suffix in (("gaussian_blur", 5, blur, ""), ("spatter", 5, spatter, ""),
                                                ("clean", None, clean, ""), ("degenerate", None, degenerate, "-degenerate")):
            rows.append(_v3_row(objective, shift, severity, n_hits, None, phase="auto", config=config + suffix, lr_search=search))
    assert v3.chosen_selectors(rows, "i2t") == {"tcr": "backoff0.5+safe"}
    recipe = v3_recipe
    monkeypatch.setattr(v3, "load", lambda out: rows)
    jobs = dict(recipe.jobs("auto", "i2t", tmp_path))
    chosen = {name: args for name, args in jobs.items() if name.endswith(("-report45", "-streams"))}
    assert list(chosen) == ["auto/i2t/tcr-backoff0.5+safe-report45", "auto/i2t/tcr-backoff0.5+safe-streams"]
    value = lambda args, flag: args[args.index(flag) + 1]  # noqa: E731
    report45, streams = chosen.values()
    assert value(report45, "--seeds") == "4,5" and value(report45, "--corruptions") == "default"
    assert value(streams, "--seeds") == "3,4,5" and all(f in streams for f in ("--clean", "--diverse", "--switch", "--degenerate"))
    assert all(value(a, "--lr_search") == value(jobs["auto/i2t/tcr-backoff0.5+safe-report"], "--lr_search") for a in chosen.values())
    labels = v3_rows
    assert {labels.selector({"objective": "tcr", "config": n.split("/")[-1]}) for n in chosen} == {"backoff0.5+safe"}


def test_v3_cheaper_phase_lists_the_transforms_the_methods_and_their_budgets(v3, monkeypatch, tmp_path):
    """Issue 39: DN, NNN and QB-Norm alone (no lr: nothing adapts); TCR and REST at their selected lrs on every batch
    and at 50 / 25 / 10 % of batches (one run per method: timed side by side), then with each transform (one run per
    method); the report split's default grid, seeds 3, 4, 5, prequential."""
    recipe = v3_recipe
    monkeypatch.setattr(v3, "load", lambda out: [])
    monkeypatch.setattr(v3, "selected_lrs", lambda rows, direction: {"tent": "1e-3", "tcr": "1e-2", "rest": "3e-3"})
    jobs = dict(recipe.jobs("cheaper", "i2t", tmp_path))
    parts = {"budgets": lambda m: [m, f"{m}+b50", f"{m}+b25", f"{m}+b10"], "transforms": lambda m: [f"{m}+dn", f"{m}+nnn", f"{m}+qbnorm"]}
    expected = {f"cheaper/i2t/{n}": n for n in ("dn", "nnn", "qbnorm")}
    expected |= {f"cheaper/i2t/{m}-{part}-lr{lr}": ",".join(rows(m)) for part, rows in parts.items() for m, lr in (("tcr", "1e-2"), ("rest", "3e-3"))}
    assert list(jobs) == list(expected)
    for folder, args in jobs.items():
        value = lambda flag: args[args.index(flag) + 1]  # noqa: E731
        assert (value("--seeds"), value("--corruptions"), value("--scoring")) == ("3,4,5", "default", "before_update")
        assert value("--objectives") == expected[folder]
        assert ("--lr" in args) == ("-lr" in folder) and (value("--lr") == folder.split("-lr")[1] if "--lr" in args else True)
    from hf_tta.benchmarks.grid import row_spec  # every listed row parses, and the budgets are what they say

    assert [row_spec(r).budget for r in parts["budgets"]("tcr")] == [None, 0.5, 0.25, 0.1]


def _cost_row(objective, shift, severity, n_hits, config, seconds, passes=(1.0, 0.0), lr=None):
    return _v3_row(objective, shift, severity, n_hits, lr=lr, phase="cheaper", config=config, seed=3, num_queries=400,
                   forward_per_query=passes[0], backward_per_query=passes[1], stream_seconds=seconds,
                   device="cuda" if config.startswith("tcr") else "cpu")


def test_v3_cheaper_table_by_hand(v3, tmp_path):
    """Two runs, each with its source (clean 400/400, contrast 1 200/400, snow 2 300/400): DN alone gains 60 on
    contrast and loses 10 on snow (share 50 / 300 = 16.7 %, worst snow −2.5: below the source), its stream 3 s a
    column against its run's source 2 s (7.50 ms a query, 1.50×); TCR at 25 % of batches gains 100 and 10 (36.7 %,
    worst snow +2.5), 1.75 forwards and 0.75 backwards a query, 20 s a column against its run's 4 s (50 ms, 5×); TCR on
    every batch of the same run gains 120 and 10 (43.3 %), so the budget row is 20 hits below it: −2.5 R@1 over 800.
    DN's run is on the CPU, TCR's on a GPU: each time names its device, the source's mean one per device (4 s and 8 s
    over 800 queries: 5 ms and 10 ms)."""
    tcr = dict(config="tcr+b25-lr1e-3", lr=1e-3)
    rows = []
    for config, src_seconds in (("dn", 2.0), (tcr["config"], 4.0)):
        rows += [_cost_row("source", "clean", None, 400, config, 2.0), _cost_row("source", "contrast", 1, 200, config, src_seconds),
                 _cost_row("source", "snow", 2, 300, config, src_seconds)]
    rows += [_cost_row("dn", "contrast", 1, 260, "dn", 3.0), _cost_row("dn", "snow", 2, 290, "dn", 3.0),
             _cost_row("tcr+b25", "contrast", 1, 300, seconds=20.0, passes=(1.75, 0.75), **tcr),
             _cost_row("tcr+b25", "snow", 2, 310, seconds=20.0, passes=(1.75, 0.75), **tcr),
             _cost_row("tcr", "contrast", 1, 320, seconds=40.0, passes=(4.0, 3.0), **tcr),
             _cost_row("tcr", "snow", 2, 310, seconds=40.0, passes=(4.0, 3.0), **tcr),
             _cost_row("rest+nnn", "contrast", 1, 300, "rest+nnn-lr3e-3", 9.0, lr=3e-3)]  # incomplete: no snow yet
    lines = v3.cheaper_lines(rows, "i2t", seeds=(3,))
    assert len(lines) == 6 and lines[2] == ("| source | – | – | – | 1.00, 0.00 | "
                                            "5.00 ms on cpu (1×, mean of 1 run); 10.00 ms on cuda (1×, mean of 1 run) |")
    dn, every, budget = lines[3].split(" | "), lines[4].split(" | "), lines[5].split(" | ")
    assert dn[0] == "| dn" and dn[1] == "16.7 %" and dn[2].startswith("Snow 2: −2.5, below the source (bound −")
    assert "not below" not in dn[2] and dn[3:] == ["–", "1.00, 0.00", "7.50 ms on cpu (1.50×) |"]
    assert every[0] == "| tcr@1e-3" and every[1] == "43.3 %" and every[3:] == ["–", "4.00, 3.00", "100.00 ms on cuda (10.00×) |"]
    assert budget[0] == "| tcr+b25@1e-3" and budget[1] == "36.7 %" and budget[2].startswith("Snow 2: +2.5, not below the source (bound ")
    # against TCR on every batch: −20 hits on contrast over 800 queries, −2.5 R@1, its interval below zero
    assert budget[3].startswith("−2.5 [−") and budget[3].endswith("]") and budget[4:] == ["1.75, 0.75", "50.00 ms on cuda (5.00×) |"]
    hi = float(budget[3].split(", ")[1].rstrip("]").replace("−", "-"))
    assert hi < 0
    old = [{k: v for k, v in r.items() if k != "stream_seconds"} if r["objective"] == "dn" else r for r in rows]
    assert v3.cheaper_lines(old, "i2t", seeds=(3,))[3].endswith("| – | – |")  # rows from before the cost columns
    exported = tmp_path / "rows.jsonl"  # the summary's `cheaper` part: the same rows on seeds 3, 4, 5, exported
    exported.write_text("".join(json.dumps({**r, "seed": seed}) + "\n" for seed in (3, 4, 5) for r in rows))
    printed = v3.summarise(exported, "i2t", part="cheaper").splitlines()
    assert printed[0].startswith("**Cheaper alternatives (i2t, report split, seeds 3, 4, 5") and printed[2:5] == lines[:3]
    assert printed[5].startswith("| dn | 16.7 % | Snow 2: −2.5, below") and printed[5].endswith("| – | 1.00, 0.00 | 7.50 ms on cpu (1.50×) |")


def test_v3_phases_name_the_missing_selection_runs(v3, monkeypatch, tmp_path, capsys):
    """A phase that needs an objective whose selection runs have not finished exits naming them and the command that
    runs them (the text tower's report before its ceilings were selected raised a KeyError)."""
    recipe = v3_recipe
    monkeypatch.setattr(v3, "load", lambda out: [])
    monkeypatch.setattr(v3, "selected_lrs", lambda rows, direction: {"tent": "1e-5", "tcr": "3e-4", "rest": "3e-4"})
    with pytest.raises(SystemExit, match=r"no finished selection runs for eata, .*oracle, oracle_all \(t2i\): run "
                                         r"`python -m hf_tta.benchmarks.protocols.v3 select --direction t2i"):
        recipe.jobs("report", "t2i", tmp_path)
    assert [name for name, _ in recipe.jobs("cheaper", "t2i", tmp_path)][-1] == "cheaper/t2i/rest-transforms-lr3e-4"
    with pytest.raises(SystemExit, match="oracle"):  # the corruptions phase needs the LayerNorm ceiling's lr
        recipe.jobs("corruptions", "i2t", tmp_path)


def test_v3_corruptions_phase_and_table_by_hand(v3, monkeypatch, tmp_path):
    """Phase ``corruptions``: the 15 test corruptions at severities 3 and 5 on seed 3, every query, for TCR, REST and
    the LayerNorm ceiling at their selected lrs and the preset (the current one while the preset phase has not chosen).
    Its table by hand: source 200/400 at severity 3 and 100/400 at 5 on two corruptions (clean 400): TCR gains 100 and
    20 at severity 3 (120 / 400 = 30 %) and 150 and 0 at 5 (150 / 600 = 25 %), 270 / 1000 = 27 % overall; its worst
    column (snow 5) is +0.0."""
    recipe = v3_recipe
    monkeypatch.setattr(v3, "load", lambda out: [])
    monkeypatch.setattr(v3, "selected_lrs", lambda rows, direction: {"tcr": "1e-2", "rest": "1e-3", "oracle": "1e-2"})
    jobs = dict(recipe.jobs("corruptions", "i2t", tmp_path))
    assert list(jobs) == ["corruptions/i2t/tcr-lr1e-2", "corruptions/i2t/rest-lr1e-3", "corruptions/i2t/oracle-lr1e-2",
                          "corruptions/i2t/recommended-lr3e-4"]
    from hf_tta.data.corruptions import TEST_IMAGE_CORRUPTIONS

    for args in jobs.values():
        value = lambda flag: args[args.index(flag) + 1]  # noqa: E731
        assert value("--corruptions").split(",") == list(TEST_IMAGE_CORRUPTIONS) and len(TEST_IMAGE_CORRUPTIONS) == 15
        assert (value("--severities"), value("--seeds"), value("--scoring"), "--limit" in args) == ("3,5", "3", "before_update", False)
    rows = [_v3_row("source", "clean", None, 400, phase="corruptions", seed=3)]
    for shift, (s3, s5, t3, t5) in {"fog": (200, 100, 300, 250), "snow": (200, 100, 220, 100)}.items():
        rows += [_v3_row("source", shift, 3, s3, phase="corruptions", seed=3), _v3_row("source", shift, 5, s5, phase="corruptions", seed=3),
                 _v3_row("tcr", shift, 3, t3, 1e-2, phase="corruptions", seed=3), _v3_row("tcr", shift, 5, t5, 1e-2, phase="corruptions", seed=3)]
    lines = v3.corruption_lines(rows, "i2t")
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert len(lines) == 3 and lines[0].startswith("| row | won back, severity 3 | won back, severity 5 | won back, all 4 |")
    assert cells[:4] == ["tcr@1e-2", "30.0 %", "25.0 %", "27.0 %"] and cells[4].startswith("+16.9 [+")
    assert cells[5].startswith("not below the source") and cells[6] == "Snow 5: +0.0"


def test_v3_text_corruptions_add_columns_into_sibling_folders_and_the_table_merges_them(v3, monkeypatch, tmp_path, capsys):
    """``--text-corruptions`` restricts every run of a phase that names text corruptions to those (its folder gets
    ``~<abbreviations>``; the streams runs are left out; a corruption a run does not name exits 2 naming it), and the
    report table merges a label's rows across its folders. By hand: source 200/400 on RS 3 and 100/400 on SR 3 (clean
    400); TCR 300/400 in its folder and 160/400 in the sibling: (100 + 60) / (200 + 300) = 32 %."""
    recipe, rows_of = v3_recipe, v3_rows
    monkeypatch.setattr(v3, "load", lambda out: [])
    monkeypatch.setattr(v3, "selected_lrs", lambda rows, direction: dict.fromkeys(recipe.OBJECTIVES, "3e-4"))
    recipe.main(["report", "--direction", "t2i", "--out", str(tmp_path), "--dry-run", "--text-corruptions", "synonym_replacement"])
    printed = capsys.readouterr().out.splitlines()
    full = dict(recipe.jobs("report", "t2i", tmp_path))
    assert printed and all(line.split()[0].endswith("~sr") for line in printed)
    assert len(printed) == sum("-streams" not in n and "-diverse" not in n for n in full)
    for line in printed:
        name, *args = line.split()
        base = full[name.removesuffix("~sr")]
        i = base.index("--text-corruptions") + 1
        assert args == [*base[:i], "synonym_replacement", *base[i + 1:]]
    with pytest.raises(SystemExit) as exit_:
        recipe.main(["report", "--direction", "t2i", "--out", str(tmp_path), "--dry-run", "--text-corruptions", "char_swap"])
    assert exit_.value.code == 2 and "char_swap not in run report/t2i/" in capsys.readouterr().err

    row = lambda *a, **k: {**_v3_row(*a, phase="report", seed=3, **k), "direction": "t2i"}  # noqa: E731
    rows = [row("source", "clean", None, 400), row("source", "random_swap", 3, 200, config="tcr-lr3e-4"),
            row("tcr", "random_swap", 3, 300, config="tcr-lr3e-4"),
            row("source", "synonym_replacement", 3, 100, config="tcr-lr3e-4~sr"),
            row("tcr", "synonym_replacement", 3, 160, config="tcr-lr3e-4~sr")]
    lines = v3.report_lines(rows, "t2i", seeds=(3,))
    cells = [c.strip() for c in lines[4].strip("|").split("|")]
    assert len(lines) == 5 and cells[:4] == ["tcr@3e-4", "75.0", "40.0", "32.0 %"]
    assert rows_of.selector({"objective": "tcr", "config": "tcr-auto+hg0.1-report~sr"}) == "auto+hg0.1"


def test_v3_runs_pass_the_device_on(tmp_path):
    """``--device`` reaches every ``hf-tta run`` of the recipe (for a lent GPU); here, without CUDA, the run refuses
    it in one line and the recipe sees the failure."""
    recipe = v3_recipe
    folder = tmp_path / "select" / "i2t" / "tcr-lr1e-3"
    code = recipe.run_folder(folder, ["--objectives", "tcr", "--lr", "1e-3"], str(tmp_path / "cache"), device="cuda")
    assert "--device cuda" in (folder / "command.txt").read_text()
    assert code == 2 and "--device cuda: CUDA is not available here; use --device cpu." in (folder / "log.txt").read_text()


def _part(folder, k, n, rows, **head):
    """One finished part of a run split over ``n`` processes, as ``hf-tta run --shard k/n`` leaves it."""
    from hf_tta.benchmarks.outputs import write_outputs

    folder.mkdir(parents=True)
    header = {"hf-tta-run": {"lr": 0.001, "device": "cpu", "scoring": "before_update", "shard": f"{k}/{n}", **head}}
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [header, *rows]))
    write_outputs(rows, str(folder), {"identity": {"scoring": "before_update"}}, plots=False)


def test_v3_a_run_split_over_processes_is_merged_into_its_folder_once_every_part_finished(tmp_path, capsys, monkeypatch):
    """``--split-runs N`` runs each run as N ``--shard k/N`` processes below its folder and merges their rows into the
    run's ``rows.jsonl`` (part 0's header without its shard, ``shards: N``) and ``results.json``; the tables read the
    run once. An unfinished part, parts of two runs, or a row in two parts is refused; N < 1 exits 2."""
    recipe, rows_of = v3_recipe, v3_rows
    row = lambda obj, shift, n_hits: {**_v3_row(obj, shift, 3 if shift != "clean" else None, n_hits, seed=3),  # noqa: E731
                                      "stream": f"i2t/{shift}", "num_queries": 400, "R@1": n_hits / 4, "R@5": 100.0, "R@10": 100.0}
    a, b, c = row("source", "clean", 400), row("source", "snow", 200), row("tcr", "snow", 300)
    run = tmp_path / "cheaper" / "i2t" / "tcr-lr1e-3"
    _part(recipe._part(run, 0, 2), 0, 2, [a, c])
    assert not (run / "rows.jsonl").exists()
    with pytest.raises(ValueError, match="shard-1-of-2: not finished"):
        recipe.merge_parts(run, 2)
    _part(recipe._part(run, 1, 2), 1, 2, [b])
    assert recipe.merge_parts(run, 2) == 3
    lines = [json.loads(line) for line in (run / "rows.jsonl").read_text().splitlines()]
    assert lines[0]["hf-tta-run"] == {"lr": 0.001, "device": "cpu", "scoring": "before_update", "shards": 2}
    assert [r["hits"] for r in lines[1:]] == [a["hits"], c["hits"], b["hits"]]
    assert len(json.loads((run / "results.json").read_text())["rows"]) == 3
    loaded = rows_of.load(tmp_path)  # the parts one level down are not read a second time
    assert sorted((r["objective"], r["shift"], r["device"]) for r in loaded) == [
        ("source", "clean", "cpu"), ("source", "snow", "cpu"), ("tcr", "snow", "cpu")]
    assert recipe._run_split(run, ["--objectives", "tcr"], str(tmp_path), "cpu", 2, None) == 0  # finished: left as is
    other = tmp_path / "other"
    _part(recipe._part(other, 0, 2), 0, 2, [a])
    _part(recipe._part(other, 1, 2), 1, 2, [b], lr=0.01)
    with pytest.raises(ValueError, match="not the 2 shards of one run"):
        recipe.merge_parts(other, 2)
    twice = tmp_path / "twice"
    _part(recipe._part(twice, 0, 2), 0, 2, [a, b])
    _part(recipe._part(twice, 1, 2), 1, 2, [b])
    with pytest.raises(ValueError, match="a row is in two parts"):
        recipe.merge_parts(twice, 2)
    with ThreadPoolExecutor(2) as pool:  # parts that finished but do not merge: one line, the run fails, nothing written
        monkeypatch.setattr(recipe, "run_folder", lambda *a, **k: 0)
        assert recipe._run_split(twice, ["--objectives", "tcr"], str(tmp_path), "cpu", 2, pool) == 1
    assert capsys.readouterr().err.strip() == f"protocol_v3: {twice}: a row is in two parts."
    assert not (twice / "rows.jsonl").exists()
    with pytest.raises(SystemExit) as exit_:
        recipe.main(["cheaper", "--out", str(tmp_path), "--split-runs", "0", "--dry-run"])
    assert exit_.value.code == 2 and "--split-runs takes a positive number" in capsys.readouterr().err


def test_v3_split_runs_start_every_part_with_its_shard_and_merge(v3, monkeypatch, tmp_path):
    """The recipe's plumbing: with ``--split-runs 2`` each selected run starts two ``hf-tta run``s with ``--shard 0/2``
    and ``--shard 1/2`` in its part folders (here each part writes the rows of its shard of a 2-row run), then the run
    folder holds the merged rows."""
    recipe = v3_recipe
    monkeypatch.setattr(v3, "load", lambda out: [])
    monkeypatch.setattr(v3, "selected_lrs", lambda rows, direction: dict.fromkeys(recipe.OBJECTIVES, "1e-3"))
    started = []

    def fake_run(folder, args, cache, device="cpu"):
        k, n = args[args.index("--shard") + 1].split("/")
        started.append((folder.relative_to(tmp_path).as_posix(), args[args.index("--objectives") + 1], k, n))
        rows = [{**_v3_row("source", "clean", None, 400, seed=3), "stream": "i2t/clean", "num_queries": 400, "R@1": 100.0,
                 "R@5": 100.0, "R@10": 100.0}, {**_v3_row("dn", "snow", 3, 300, seed=3), "stream": "i2t/snow", "num_queries": 400,
                                                "R@1": 75.0, "R@5": 100.0, "R@10": 100.0}]
        _part(folder, int(k), int(n), rows[int(k)::int(n)])
        return 0

    monkeypatch.setattr(recipe, "run_folder", fake_run)
    with pytest.raises(SystemExit) as exit_:
        recipe.main(["cheaper", "--out", str(tmp_path), "--only", "cheaper/i2t/dn", "--split-runs", "2", "--jobs", "2"])
    assert exit_.value.code == 0
    assert sorted(started) == [("cheaper/i2t/dn/shard-0-of-2", "dn", "0", "2"), ("cheaper/i2t/dn/shard-1-of-2", "dn", "1", "2")]
    merged = (tmp_path / "cheaper" / "i2t" / "dn" / "rows.jsonl").read_text().splitlines()
    assert len(merged) == 3 and json.loads(merged[0])["hf-tta-run"]["shards"] == 2
