"""``hf-tta list`` shows every benchmark of the papers with what it needs and its status (issue 28, item 4); the
catalog's build commands name options that exist."""

from __future__ import annotations

import re

from hf_tta import cli
from hf_tta.benchmarks.catalog import CATALOG, markdown_table


def test_list_shows_every_benchmark_with_needs_and_status(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    for e in CATALOG:
        assert f"  {e.name} [{e.status}]" in out and e.raw_files in out and e.model in out
    for name in ("FIQ-O / FIQ-D", "CIRR-O / CIRR-D", "Fashion-Gen-D", "CUHK2ICFG / ICFG2CUHK", "General2Nocaps ID / ND / OD", "AudioSet2VGG"):
        assert name in out
    assert "noise_char" in out


def test_catalog_build_commands_name_existing_options():
    from hf_tta.cli.arguments import build_parser

    build = next(a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "build")[1]
    flags = {o for a in build._actions for o in a.option_strings}
    for e in CATALOG:
        if e.build.startswith("hf-tta build"):
            used = set(re.findall(r"(--[a-z-]+)", e.build.split(";")[0]))
            assert used <= flags, (e.name, used - flags)
    table = markdown_table().splitlines()
    assert len(table) == len(CATALOG) + 2 and all(len(re.findall(r"(?<!\\)\|", row)) == 8 for row in table)
