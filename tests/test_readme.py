"""The README's offline example runs as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_offline_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    runnable = [b for b in blocks if "CLIPConfig(" in b]  # the offline example: a tiny CLIP from its config
    assert runnable, "README lost its offline example"
    exec(compile(runnable[0], str(README), "exec"), {})
    out = capsys.readouterr().out
    assert "R@1" in out and "mAP" in out
