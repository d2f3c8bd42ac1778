"""The README and the cards run as written (issue 50): every Python block runs, every ``TTAConfig(...)`` spelling
builds, and every ``hf-tta`` option exists, all without a FutureWarning (the deprecated flat spellings warn).

* A Python block runs offline as it stands (with ``warnings`` turning FutureWarning into an error), unless the line
  before it is ``<!-- example: syntax-only -->`` (it downloads a checkpoint or needs the reader's data): such a block
  must parse, and each ``TTAConfig(...)`` call in it whose arguments are literals is built on its own.
* Every ``TTAConfig(...)`` / ``TTAConfig.recommended(...)`` written in the prose (an inline code span) is built.
* Every ``hf-tta <command> ...`` code span or line names only options that command's parser knows.

The archived results cards (``*-v1.md``, ``*-v2.md``, ``*-v3.md``) are history and are not checked.
"""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest

import hf_tta

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "model_cards").glob("*.md") if not re.search(r"-v\d+\.md$", p.name))]
SYNTAX_ONLY = "<!-- example: syntax-only -->"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
CONFIG_SPAN = re.compile(r"`(TTAConfig(?:\.recommended)?\(.*?\))`")
CLI_SPAN = re.compile(r"`(hf-tta(?: [^`]*)?)`|^(hf-tta [^\n]*)$", re.M)
CONFIG_NAMES = ("TTAConfig", "TuningConfig", "GradientDecouplingConfig", "ConsistencyConfig", "RunConfig", "SafetyConfig")


def _blocks():
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for m in BLOCK.finditer(text):
            line = text[: m.start()].count("\n") + 1
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            yield pytest.param(m.group(1), before.strip() == SYNTAX_ONLY, id=f"{doc.name}:{line}")


def _namespace() -> dict:
    return {name: getattr(hf_tta, name) for name in CONFIG_NAMES if hasattr(hf_tta, name)}


def _build_configs(code: str) -> int:
    """Build every TTAConfig(...) call of ``code`` whose arguments are literals (or nested configs); how many."""
    built = 0
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("TTAConfig", "TTAConfig.recommended"):
            try:
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    if not (isinstance(arg, ast.Call) and ast.unparse(arg.func) in CONFIG_NAMES):
                        ast.literal_eval(arg)
            except ValueError:
                continue  # an argument names a variable of the example: the block runs it, or it is syntax-only
            with warnings.catch_warnings():
                warnings.simplefilter("error", FutureWarning)
                eval(compile(ast.Expression(node), "<doc>", "eval"), _namespace())  # noqa: S307 - our own docs
            built += 1
    return built


@pytest.mark.parametrize("code, syntax_only", list(_blocks()))
def test_every_python_block_runs_without_a_future_warning(code, syntax_only):
    if syntax_only:
        ast.parse(code)
        _build_configs(code)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        exec(compile(code, "<doc>", "exec"), {"__name__": "__doc_example__"})  # noqa: S102 - our own docs


def _config_spans():
    for doc in DOCS:
        for m in CONFIG_SPAN.finditer(doc.read_text(encoding="utf-8")):
            yield pytest.param(m.group(1), id=f"{doc.name}:{m.group(1)[:60]}")


@pytest.mark.parametrize("spelling", list(_config_spans()))
def test_every_config_spelling_in_the_prose_builds(spelling):
    assert _build_configs(spelling) == 1, f"{spelling}: not a TTAConfig call with literal arguments"


def _cli_spans():
    for doc in DOCS:
        for m in CLI_SPAN.finditer(doc.read_text(encoding="utf-8")):
            yield pytest.param(m.group(1) or m.group(2), id=f"{doc.name}:{(m.group(1) or m.group(2))[:60]}")


@pytest.mark.parametrize("spelling", list(_cli_spans()))
def test_every_hf_tta_option_exists(spelling):
    from hf_tta.cli.arguments import SUBCOMMANDS, build_parser

    words = spelling.split()
    command = words[1] if len(words) > 1 and words[1] in SUBCOMMANDS else "run"
    if command == "serve":  # the service's own parser (hf_tta.cli.serve)
        from hf_tta.cli.serve import parser as serve_parser

        sub = serve_parser()
    else:
        parser = build_parser(config_options=True)
        sub = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices[command]
    known = {o for a in sub._actions for o in a.option_strings}
    used = {w.split("=")[0] for w in words if w.startswith("--")}
    assert used <= known, f"`{spelling}`: hf-tta {command} has no {sorted(used - known)}"
