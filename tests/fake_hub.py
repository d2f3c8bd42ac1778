"""An offline stand-in for the Hugging Face Hub, for ``push_to_hub`` tests.

``datasets`` pushes through ``HfApi`` (``repo_info``, ``create_repo``, ``create_branch``, ``preupload_lfs_files``,
``create_commit``) and reads the repository back through ``HfFileSystem``; both are patched in
``datasets.arrow_dataset`` and ``datasets.dataset_dict`` so that a push writes the Hub layout
(``README.md``, ``<config>/test-00000-of-00001.parquet``) into a local folder, which ``load_dataset(folder, config)``
then reads like the real repository. It relies on private internals of ``datasets`` (checked with datasets 5.2):
keep one such test per benchmark and round-trip ``save_to_disk`` elsewhere.

Usage::

    def test_push(fake_hub):                      # the fixture from conftest-style import below
        ds.push_to_hub("me/bench", config_name="clean", split="test")
        load_dataset(str(fake_hub.repo_dir("me/bench")), "clean", split="test")
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from fsspec.implementations.local import LocalFileSystem

SHA = "0" * 40


@dataclass
class _RepoInfo:
    id: str
    sha: str = SHA


@dataclass
class _RepoUrl:
    repo_id: str


class FakeHub:
    """The Hub's repositories as folders under ``root``: ``root/<owner>/<name>/...``."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.commits: list[tuple[str, str, list[str]]] = []  # (repo_id, message, paths written)

    def repo_dir(self, repo_id: str) -> Path:
        return self.root / repo_id

    # ------------------------------------------------------------------ HfApi surface
    def api(self, *args, **kwargs) -> "FakeHub":  # used as the HfApi class: HfApi(endpoint=..., token=...)
        return self

    def repo_info(self, repo_id, repo_type=None, revision=None, **kwargs):
        self.repo_dir(repo_id).mkdir(parents=True, exist_ok=True)
        return _RepoInfo(repo_id)

    def create_repo(self, repo_id, repo_type=None, private=None, exist_ok=False, **kwargs):
        self.repo_dir(repo_id).mkdir(parents=True, exist_ok=True)
        return _RepoUrl(repo_id)

    def create_branch(self, *args, **kwargs):
        return None

    def preupload_lfs_files(self, repo_id, additions, **kwargs):
        # datasets deletes the temporary parquet file right after this call: keep its bytes.
        for op in additions:
            op._fake_bytes = _read(op.path_or_fileobj)

    def create_commit(self, repo_id, operations, commit_message="", **kwargs):
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        written = []
        for op in operations:
            target = self.repo_dir(repo_id) / op.path_in_repo
            if isinstance(op, CommitOperationAdd):
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(getattr(op, "_fake_bytes", None) or _read(op.path_or_fileobj))
                written.append(op.path_in_repo)
            elif isinstance(op, CommitOperationDelete) and target.exists():
                shutil.rmtree(target) if target.is_dir() else target.unlink()
        self.commits.append((repo_id, commit_message, written))
        return None

    def hf_hub_download(self, repo_id, filename, repo_type=None, revision=None, **kwargs) -> str:
        from huggingface_hub.errors import EntryNotFoundError

        path = self.repo_dir(repo_id) / filename
        if not path.is_file():
            raise EntryNotFoundError(f"{filename} is not in {repo_id}.")
        return str(path)

    def upload_file(self, path_or_fileobj, path_in_repo, repo_id, commit_message="", **kwargs):
        from huggingface_hub import CommitOperationAdd

        return self.create_commit(repo_id, [CommitOperationAdd(path_in_repo, path_or_fileobj)], commit_message)

    # ------------------------------------------------------------------ HfFileSystem surface
    def filesystem_class(self) -> type:
        hub = self

        class FakeHfFileSystem(LocalFileSystem):
            """``datasets/<owner>/<name>@<rev>/<path>`` -> ``root/<owner>/<name>/<path>``."""

            def __init__(self, *args, **kwargs):
                super().__init__()

            @classmethod
            def _strip_protocol(cls, path):
                path = str(path)
                if path.startswith(str(hub.root)):  # fsspec strips more than once: stay idempotent
                    return LocalFileSystem._strip_protocol(path)
                for prefix in ("hf://", "datasets/"):
                    if path.startswith(prefix):
                        path = path[len(prefix) :]
                owner, rest = path.split("/", 1) if "/" in path else (path, "")
                name, _, inner = rest.partition("/")
                name = name.split("@", 1)[0]
                return LocalFileSystem._strip_protocol(str(hub.root / owner / name / inner))

        return FakeHfFileSystem


def _read(obj) -> bytes:
    if isinstance(obj, (bytes, bytearray)):
        return bytes(obj)
    if isinstance(obj, (str, Path)):
        return Path(obj).read_bytes()
    obj.seek(0)
    return obj.read()


@pytest.fixture
def fake_hub(tmp_path, monkeypatch) -> FakeHub:
    """Patch ``datasets``' Hub access; ``fake_hub.api()`` is also the ``api=`` to give card helpers."""
    import datasets.arrow_dataset
    import datasets.dataset_dict

    hub = FakeHub(tmp_path / "hub")
    fs = hub.filesystem_class()
    for module in (datasets.arrow_dataset, datasets.dataset_dict):
        monkeypatch.setattr(module, "HfApi", hub.api)
        monkeypatch.setattr(module, "HfFileSystem", fs)
    return hub
