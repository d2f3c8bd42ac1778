"""Saving and loading a wrapper, locally and on the Hugging Face Hub: :class:`CheckpointMixin` gives
``save_pretrained`` / ``load_state`` / ``from_pretrained`` / ``push_to_hub`` over two hooks of the wrapper
(``checkpoint_payload`` and ``load_checkpoint``); the folder format is :mod:`hf_tta.checkpoint`'s. Pushing writes a
model card; loading resolves a repo id or a local folder (through ``huggingface_hub``)."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import checkpoint
from .checkpoint import CONFIG_FILE, STATE_FILE, describe_fingerprint
from .config import TTAConfig
from .models.base import ModelAdapter
from .version import __version__

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
CARD_FILE = "README.md"


def source_model_name(model) -> str:
    """The Hub id or path the source model was loaded from (``config._name_or_path``), else its class name."""
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return name or type(model).__name__


def model_card(wrapper: "CheckpointMixin", repo_id: str) -> str:
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
    wrapper: "CheckpointMixin",
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


class CheckpointMixin:
    """``save_pretrained`` / ``load_state`` / ``from_pretrained`` / ``push_to_hub`` for a wrapper that implements
    ``checkpoint_payload() -> (config, tensors, metadata)`` and ``load_checkpoint(ckpt)`` (which checks everything
    before it changes anything), ``fingerprint()`` and, for :meth:`from_pretrained`, ``_init_kwargs(config)``."""

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write the checkpoint folder, atomically (written beside it, then renamed into place; see
        :mod:`hf_tta.checkpoint`): ``tta_config.json`` (the full resolved config) and ``tta_state.safetensors``
        (adapted parameters, optimiser and objective state, batch counter, RNG state, the config again and the model
        fingerprint), so that a resumed stream continues exactly where it stopped."""
        config, tensors, meta = self.checkpoint_payload()
        meta = {**meta, "fingerprint": self.fingerprint(), "hf_tta_version": __version__}
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        checkpoint.write_checkpoint(save_directory, {**config, "hf_tta_version": __version__}, tensors, meta)

    def load_state(self, directory: str | os.PathLike) -> None:
        """Load what :meth:`save_pretrained` wrote into this wrapper (same source model and config). A checkpoint
        adapted from another model, or saved with another config, is refused with a message naming the difference;
        nothing changes on a refusal."""
        self.load_checkpoint(checkpoint.read_checkpoint(directory))

    @classmethod
    def _init_kwargs(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The constructor's keyword arguments from a checkpoint's config (a routed checkpoint's is refused here,
        before the model is wrapped: TTAConfig refuses keys it does not define)."""
        if "routing" in config:
            raise ValueError("This checkpoint holds one adapter per domain (saved by RoutedTTAWrapper): load it with "
                             "RoutedTTAWrapper.from_pretrained.")
        return {"config": TTAConfig.from_dict(config)}

    @classmethod
    def from_pretrained(
        cls, model: nn.Module | ModelAdapter, repo_id_or_path: str | os.PathLike, *, revision: str | None = None,
        token: str | None = None, api=None,
    ):
        """Rebuild a wrapper around the *source* ``model`` and load the adapted state saved by :meth:`save_pretrained`
        in a local folder, or pushed by :meth:`push_to_hub` to a Hub repository (``revision`` pins a commit).

        The checkpoint's fingerprint is checked before the model is touched: a checkpoint adapted from another model
        is refused with a message naming both.
        """
        folder = resolve_checkpoint_folder(repo_id_or_path, revision=revision, token=token, api=api)
        ckpt = checkpoint.read_checkpoint(folder)
        if ckpt.fingerprint is not None:  # weights too, before the wrapper touches the model
            base = model.model if isinstance(model, ModelAdapter) else model
            fp = ckpt.fingerprint
            source = checkpoint.unwrapped_source(base, fp["adapted"]) if fp.get("source_sha256") else None
            current = checkpoint.model_fingerprint(base, {}, source, ckpt.legacy_names)
            mismatch = checkpoint.fingerprint_mismatch(fp, current, check_params=False)
            if mismatch:
                raise ValueError(mismatch)
        wrapper = cls(model, **cls._init_kwargs(dict(ckpt.config)))
        wrapper.load_state(folder)  # through the (overridable) public path, e.g. DistributedTTAWrapper's barrier
        return wrapper

    def push_to_hub(
        self, repo_id: str, *, private: bool | None = None, token: str | None = None, revision: str | None = None,
        commit_message: str | None = None, api=None,
    ) -> str:
        """Push the checkpoint (as :meth:`save_pretrained` writes it) and a model card recording the source model,
        the objective, the stream length and the config to the Hub repository ``repo_id``, in one commit.
        ``api`` is an ``HfApi``-like object (default ``HfApi(token=token)``). Returns ``repo_id``."""
        return push_checkpoint(self, repo_id, private=private, token=token, revision=revision, commit_message=commit_message, api=api)

    def checkpoint_payload(self) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:  # pragma: no cover
        raise NotImplementedError

    def load_checkpoint(self, ckpt: checkpoint.Checkpoint) -> None:  # pragma: no cover
        raise NotImplementedError
