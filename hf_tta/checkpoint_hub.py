"""TTA checkpoints on the Hugging Face Hub, both ways: push a checkpoint with its model card, resolve a repo id or a
local folder to a checkpoint folder (through ``huggingface_hub``)."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checkpoint import CONFIG_FILE, STATE_FILE, describe_fingerprint

if TYPE_CHECKING:  # pragma: no cover
    from .wrapper import TTAWrapper

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
CARD_FILE = "README.md"


def source_model_name(model) -> str:
    """The Hub id or path the source model was loaded from (``config._name_or_path``), else its class name."""
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return name or type(model).__name__


def model_card(wrapper: "TTAWrapper", repo_id: str) -> str:
    """A model card recording the source model, the objective, the stream length and the full config."""
    from huggingface_hub import ModelCard, ModelCardData

    source = source_model_name(wrapper.model)
    config = wrapper.resolved_config()
    fingerprint = wrapper.fingerprint()
    on_hub = bool(_REPO_ID.match(source)) and not os.path.exists(source)
    data = ModelCardData(
        library_name="hf_tta",
        base_model=source if on_hub else None,
        tags=["hf_tta", "test-time-adaptation", "retrieval", config.objective],
    )
    loader = f"{type(wrapper.model).__name__}.from_pretrained({source!r})" if on_hub else "...  # the source model"
    rows = [
        ("source model", f"`{source}`"),
        ("model fingerprint", describe_fingerprint(fingerprint)),
        ("objective", f"`{config.objective}`" + (f" + score transform `{config.score_transform}`" if config.score_transform else "")),
        ("retrieval", f"{wrapper.query_modality} queries -> {wrapper.gallery_modality} gallery"),
        ("stream length", f"{_batches(wrapper.batch_index)} adapted ({config.steps} steps each, reset policy `{config.reset_policy}`)"),
        ("adapted tensors", str(len(wrapper.params))),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    body = f"""
# Test-time adapted `{source}`

An hf_tta checkpoint: the state of a `TTAWrapper` after online test-time adaptation of
`{source}` with `{config.objective}` (adapted parameters, optimiser and objective state, stream position and RNG).
It is not a standalone model: load it onto the source model it was adapted from.

| | |
|---|---|
{table}

## Load

```python
from transformers import {type(wrapper.model).__name__}
from hf_tta import TTAWrapper

model = {loader}
tta = TTAWrapper.from_pretrained(model, {repo_id!r})   # refuses another model, naming both
```

## Config (`{CONFIG_FILE}`, every default written out)

```json
{json.dumps(config.to_dict(), indent=2, sort_keys=True)}
```
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}").content


def _batches(n: int) -> str:
    return f"{n} batch" if n == 1 else f"{n} batches"


def push_checkpoint(
    wrapper: "TTAWrapper",
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    api: Any = None,
) -> str:
    """Save ``wrapper`` into a temporary folder and push it with its card to ``repo_id`` in one commit."""
    from huggingface_hub import CommitOperationAdd, HfApi

    if not isinstance(repo_id, str) or not _REPO_ID.match(repo_id):
        raise ValueError(f"repo_id must look like 'owner/name', got {repo_id!r}.")
    api = api or HfApi(token=token)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "checkpoint"
        wrapper.save_pretrained(folder)
        (folder / CARD_FILE).write_text(model_card(wrapper, repo_id), encoding="utf-8")
        api.create_repo(repo_id, private=private, exist_ok=True)
        operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(folder / name)) for name in (*(CONFIG_FILE, STATE_FILE), CARD_FILE)]
        message = commit_message or f"hf_tta checkpoint: {wrapper.config.objective} after {_batches(wrapper.batch_index)}"
        api.create_commit(repo_id, operations=operations, commit_message=message, revision=revision)
    return repo_id


def resolve_checkpoint_folder(
    repo_id_or_path: str | os.PathLike, *, revision: str | None = None, token: str | None = None, api: Any = None
) -> Path:
    """A local folder holding the checkpoint: ``repo_id_or_path`` itself when it is a local folder (or the backup an
    interrupted save left beside it), else the Hub repository's files at one commit, downloaded to the cache."""
    path = Path(repo_id_or_path)
    if path.is_dir() or path.with_name(f".{path.name}.old").is_dir() or not _REPO_ID.match(str(repo_id_or_path)):
        return path  # read_checkpoint explains a missing folder
    from huggingface_hub import HfApi
    from huggingface_hub.errors import OfflineModeIsEnabled

    repo_id = str(repo_id_or_path)
    api = api or HfApi(token=token)
    try:  # pin one commit, so that both files come from the same push
        revision = api.repo_info(repo_id, revision=revision).sha or revision
    except OfflineModeIsEnabled:
        pass  # offline: the cache's copy of `revision`
    state = api.hf_hub_download(repo_id, STATE_FILE, revision=revision)
    api.hf_hub_download(repo_id, CONFIG_FILE, revision=revision)  # the readable copy, beside it in the snapshot
    return Path(state).parent
