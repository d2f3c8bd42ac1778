"""Protocol v4's registry: a study's registration and choice must be committed, unchanged, before its runs, and each
run folder records the commits it ran under (:mod:`.v4` runs them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
REGISTRATIONS = Path("model_cards/results/protocol-v4/registrations")
CHOICES = Path("model_cards/results/protocol-v4/choices")


def load_choice(study: str, repo: Path = REPO) -> dict | None:
    """A study's committed choice (``choices/<study>.json``, written from selection rows by :mod:`.v4_choice`), or
    ``None`` before it is made."""
    path = repo / CHOICES / f"{study}.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def registration_path(study: str, repo: Path = REPO) -> Path:
    return repo / REGISTRATIONS / f"{study}.json"


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)


def check_registered(study: str, repo: Path = REPO) -> str:
    """The commit that registered ``study``; a ``ValueError`` in one line when its registration file is missing, not
    committed, or changed since its last commit (a run must not start before its study's rules are in git)."""
    return _committed(registration_path(study, repo), repo, f"study {study!r}", "its registration")


def check_chosen(study: str, repo: Path = REPO) -> str:
    """The commit of ``study``'s choice (``choices/<study>.json``), which its report runs need committed, as
    :func:`check_registered` checks a registration."""
    return _committed(repo / CHOICES / f"{study}.json", repo, f"the report of study {study!r}", "its choice")


def _committed(path: Path, repo: Path, who: str, what: str) -> str:
    rel = path.relative_to(repo)
    if not path.is_file():
        raise ValueError(f"{who} has no registration ({rel}): write and commit it before its first run."
                         if what == "its registration" else f"{who} needs {what} ({rel}): make it from selection rows "
                         "(hf_tta.benchmarks.protocols.v4_choice) and commit it first.")
    json.loads(path.read_text(encoding="utf-8"))  # JSON; a broken file fails here
    commit = _git(repo, "log", "-1", "--format=%H", "--", str(rel)).stdout.strip()
    if not commit:
        raise ValueError(f"{who}: {what} {rel} is not committed: `git add {rel} && git commit` before its first run.")
    if _git(repo, "diff", "--quiet", "HEAD", "--", str(rel)).returncode != 0:
        raise ValueError(f"{who}: {what} {rel} changed since {commit[:7]}: commit the change (and say in the card that "
                         "it changed after rows were read, if any were) before running.")
    return commit


def run_folder(folder: Path, args: list[str], cache: str, registration: str, device: str = "cpu") -> int:
    """One ``hf-tta run`` of ``args`` into ``folder`` (one thread, offline, plots off; its command line in
    ``command.txt``, the registration commit in ``registration.txt``, its output appended to ``log.txt``)."""
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "hf_tta.cli", "run", *args, "--output-dir", str(folder), "--cache-dir", cache,
           "--no-plots", "--quiet", "--threads", "1", *(["--device", device] if device != "cpu" else [])]
    (folder / "command.txt").write_text(" ".join(cmd) + "\n")
    (folder / "registration.txt").write_text(registration + "\n")
    head = _git(REPO, "rev-parse", "HEAD").stdout.strip()
    dirty = _git(REPO, "status", "--porcelain", "--untracked-files=no", "--", "hf_tta").stdout.strip()
    (folder / "commit.txt").write_text(head + (" (hf_tta/ modified)" if dirty else "") + "\n")  # the library it ran
    with open(folder / "log.txt", "a") as log:
        return subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
