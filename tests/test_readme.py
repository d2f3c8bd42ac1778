"""The README is a short front page that tells the truth, and the model cards it points to hold the rest.

Checked here: the README's offline example runs as written; its install-and-test command is the one ``.ci/run``
extracts; every Python block of the README and the model cards compiles and uses only names the library has; every
link, anchor and repository path they name exists; every API name, module and ``hf-tta`` option the README names
exists; the layout section maps every module of the package; and the README stays a front page (at most 350 lines,
no commit hashes: measurements and their commits live in ``model_cards/``).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CARDS = sorted((ROOT / "model_cards").glob("*.md"))
DOCS = [README, *CARDS]
NAMESPACES = ("hf_tta", "hf_tta.routing", "hf_tta.gallery", "hf_tta.objectives", "hf_tta.objectives.cliptta", "hf_tta.models", "hf_tta.metrics",
              "hf_tta.data.builders", "transformers")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def _text(path: pathlib.Path) -> str:
    return path.read_text(encoding="utf-8")


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section, up to the next ``## `` heading."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert match, f"README lost its '## {heading}' section"
    return match.group(1)


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _resolve(dotted: str):
    """The object a dotted name stands for: a module of the package, or a name in one of :data:`NAMESPACES`."""
    if dotted.startswith("hf_tta."):
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            name = ".".join(parts[:i])
            try:
                found = importlib.util.find_spec(name) is not None
            except ModuleNotFoundError:  # a name inside a module (hf_tta.logging.set_verbosity_info), not a submodule
                found = False
            if found:
                obj = importlib.import_module(name)
                for attr in parts[i:]:
                    obj = getattr(obj, attr)
                return obj
    head, *rest = dotted.split(".")
    for namespace in NAMESPACES:
        module = importlib.import_module(namespace)
        if hasattr(module, head):
            obj = getattr(module, head)
            for attr in rest:
                obj = getattr(obj, attr)
            return obj
    raise AttributeError(f"{dotted} is in no namespace of {NAMESPACES}")


def test_readme_offline_example_runs(capsys):
    runnable = [b for b in _blocks(_text(README), "python") if "CLIPConfig(" in b]  # a tiny CLIP from its config
    assert runnable, "README lost its offline example"
    exec(compile(runnable[0], str(README), "exec"), {})
    out = capsys.readouterr().out
    assert "R@1" in out and "mAP" in out


def test_readme_install_block_is_the_command_ci_runs():
    """``.ci/run`` takes the first line after the first ```bash after '## Install and test' (its awk); that line
    must install the ``test`` extra, lint and run pytest."""
    lines = _text(README).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## Install and test"))
    fence = next(i for i in range(start, len(lines)) if lines[i].startswith("```bash"))
    cmd = lines[fence + 1]
    assert "python -m pytest" in cmd and "ruff check ." in cmd and '-e ".[test]"' in cmd
    assert lines[fence + 2] == "```", "the install-and-test command must stay one line (.ci/run reads one line)"
    assert "## Install and test" in _text(ROOT / ".ci" / "run")
    pyproject = _text(ROOT / "pyproject.toml")
    table = re.search(r"^\[project\.optional-dependencies\]\n(.*?)(?=^\[)", pyproject, flags=re.S | re.M).group(1)
    extras = set(re.findall(r"^([\w-]+)\s*=", table, flags=re.M))
    for extra in ("data", "audio", "bench", "index", "dev", "test"):  # the extras the section names
        assert extra in extras and f"`{extra}`" in _section(_text(README), "Install and test")
    # the suite on both cores of the CI machine (issue 36): pytest-xdist, from the dev extra
    assert re.search(r"python -m pytest -n \S+", cmd) and re.search(r'^dev = \[[^\]]*"pytest-xdist', table, flags=re.M | re.S)


def test_readme_is_a_front_page():
    text = _text(README)
    assert len(text.splitlines()) <= 350
    assert not COMMIT.findall(text), "the README names commits: measurements and their commits go to model_cards/"
    for heading in ("Install and test", "Run the main job (offline, any machine)", "Which options, when", "Layout",
                    "Where the rest is"):
        _section(text, heading)
    for card in CARDS:  # the README points at every card
        assert f"(model_cards/{card.name})" in text, f"README does not point at {card.name}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_python_blocks_compile_and_use_real_names(path):
    """Every Python block compiles; its imports from hf_tta / transformers resolve; ``tta.x`` and ``Class.x`` name
    attributes the classes have (``tta`` being whatever class the block builds it from)."""
    for block in _blocks(_text(path), "python"):
        tree = ast.parse(block, filename=str(path))
        names = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("hf_tta", "transformers"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    names[alias.asname or alias.name] = getattr(module, alias.name)
        for node in ast.walk(tree):  # tta = SomeWrapper(...) / SomeWrapper.from_pretrained(...)
            if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["tta"]
                    and isinstance(node.value, ast.Call)):
                func = node.value.func
                cls = func.id if isinstance(func, ast.Name) else getattr(func.value, "id", None)
                names["tta"] = names.get(cls) or _resolve(cls)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in names:
                owner = names[node.value.id]
                if isinstance(owner, type) or node.value.id == "tta":
                    assert hasattr(owner, node.attr), f"{path.name}: {node.value.id}.{node.attr} does not exist"


def _links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_links_anchors_and_paths_exist(path):
    text = _text(path)
    for link in _links(text):
        if re.match(r"^[a-z]+://", link) or link.startswith("mailto:"):
            continue
        target, _, anchor = link.partition("#")
        target_path = (path.parent / target).resolve() if target else path
        assert target_path.exists(), f"{path.name} links to {link}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", _text(target_path), flags=re.M)
            assert anchor in {_slug(h) for h in headings}, f"{path.name}: no heading for #{anchor} in {target_path.name}"
    for span in re.findall(r"`([^`\n]+)`", text):  # repository paths named in code spans
        for token in span.split():
            token = token.strip("\"',;:()")
            if re.match(r"^(hf_tta|recipes|tests|model_cards|\.ci)/[\w./-]*$", token):
                assert (ROOT / token).exists(), f"{path.name} names {token}, which does not exist"
            elif path in CARDS and re.match(r"^[\w.-]+\.md$", token) and token not in ("README.md", "results.md"):
                assert (path.parent / token).exists(), f"{path.name} names {token}, which is not a card"


def test_readme_api_names_exist():
    """Every class, ``Class.attribute`` and ``hf_tta.module`` the README names in code spans exists."""
    found = set()
    for span in re.findall(r"`([^`\n]+)`", _text(README)):
        if re.match(r"^[A-Z][A-Z0-9_]*=", span):  # an environment variable, not an API name
            continue
        m = re.match(r"^((?:hf_tta\.)?[A-Za-z_]\w*(?:\.\w+)*)", span)
        if not m or not (m.group(1)[0].isupper() or m.group(1).startswith("hf_tta.")):
            continue
        if m.group(1).rsplit(".", 1)[-1] in ("md", "py", "json", "toml"):  # a file name, not an API name
            continue
        _resolve(m.group(1))
        found.add(m.group(1))
    assert {"TTAWrapper", "TTAConfig.recommended", "RoutedTTAWrapper", "DistributedTTAWrapper"} <= found


def test_readme_cli_options_exist():
    """The ``hf-tta`` subcommands and options the README names (from its main-job section on) are the parser's."""
    from hf_tta.cli.arguments import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    options = {s for p in (parser, *subparsers.values()) for a in p._actions for s in a.option_strings}
    text = _text(README)
    text = text[text.index("## Run the main job"):]
    spans = re.findall(r"`([^`\n]+)`", text) + _blocks(text, "bash")
    named = {m for span in spans for m in re.findall(r"(?<![\w-])--[a-z][a-z-]*", span)}
    assert {"--seeds", "--objectives", "--full", "--fresh", "--model", "--dataset"} <= named
    assert named <= options, f"options the parser does not have: {sorted(named - options)}"
    commands = {m for span in spans for m in re.findall(r"hf-tta (\w+)", span)}
    assert commands and commands <= set(subparsers), commands


def test_layout_maps_every_module():
    """The layout section names real modules, and every top-level module and subpackage of hf_tta."""
    layout = _section(_text(README), "Layout")
    named = set(re.findall(r"`(hf_tta(?:\.\w+)+)`", layout))
    for name in named:
        assert importlib.util.find_spec(name) is not None, f"Layout names {name}, which does not exist"
    package = ROOT / "hf_tta"
    modules = {f"hf_tta.{p.stem}" for p in package.glob("*.py") if p.stem not in ("__init__", "version")}
    modules |= {f"hf_tta.{p.parent.name}" for p in package.glob("*/__init__.py")}
    assert modules <= named, f"Layout does not map {sorted(modules - named)}"
    for rule in ("Objectives never see a model", "Adapters never know the loop", "Data never knows TTA",
                 "Metrics are pure torch"):
        assert rule in layout


def test_cards_name_the_commits_of_their_figures():
    """The pages that took the README's measurements name commits (each figure's provenance moved with it); the
    guarantees card quotes none since issue 50 removed its figures without committed rows, and says so."""
    assert "quotes no measurement" in _text(ROOT / "model_cards" / "guarantees.md")
    for name in ("scaling.md", "options.md", "architecture.md", "emoji-benchmark-results.md"):
        text = _text(ROOT / "model_cards" / name)
        assert COMMIT.search(text), f"{name} names no commit"
        for paragraph in re.split(r"\n\s*\n", text):  # a paragraph that says "Measured on" says on which commit
            if re.search(r"\bMeasured on\b", paragraph):
                assert re.search(r"commits?\b", paragraph), f"{name}: a measurement without its commit: {paragraph[:80]}"
