"""Publish built benchmarks to the Hugging Face Hub (the top of the builders): every config with
``push_to_hub(config_name=...)``, then the generated dataset card (``huggingface_hub.DatasetCard``), keeping the
``configs`` / ``dataset_info`` metadata that ``push_to_hub`` wrote."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from ...logging import tqdm
from .base import BUILD_INFO, CLEAN, SPLIT, built_configs
from .card import card_metadata, card_text
from .specs import BenchmarkSpec, benchmark_spec, parse_config_name

logger = logging.getLogger(__name__)


def _order(configs: Iterable[str]) -> list[str]:
    """clean first, then image, then text configs (the order of the card and of the Hub viewer)."""
    def key(c: str):
        spec = parse_config_name(c)
        return ({None: 0, "image": 1, "text": 2}[spec.modality], spec.corruption == "diverse", c)

    return sorted(configs, key=key)


def read_remote_card(repo_id: str, api, revision: str | None = None):
    """The repository's current ``DatasetCard``, or ``None`` when it has none (or the repo does not exist)."""
    from huggingface_hub import DatasetCard
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        path = api.hf_hub_download(repo_id, "README.md", repo_type="dataset", revision=revision)
    except (EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError):
        return None
    return DatasetCard.load(path)


def _commit_card(api, repo_id: str, data: dict, body: str, commit_message: str, revision: str | None = None):
    """Commit ``README.md`` = YAML ``data`` + Markdown ``body`` to the dataset repository."""
    from huggingface_hub import CommitOperationAdd, DatasetCard, DatasetCardData

    card = DatasetCard(f"---\n{DatasetCardData(**data).to_yaml()}\n---\n\n{body.lstrip()}")
    return api.create_commit(
        repo_id,
        operations=[CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=str(card).encode("utf-8"))],
        commit_message=commit_message,
        repo_type="dataset",
        revision=revision,
    )


def remote_configs(repo_id: str, api, revision: str | None = None) -> list[str]:
    """Config names declared in the repository's card (what ``push_to_hub`` already published)."""
    card = read_remote_card(repo_id, api, revision)
    if card is None:
        return []
    return [c.get("config_name") for c in (card.data.to_dict().get("configs") or []) if c.get("config_name")]


def push_card(
    repo_id: str,
    spec: BenchmarkSpec,
    build_info: dict,
    api=None,
    token: str | None = None,
    revision: str | None = None,
    commit_message: str = "Update dataset card",
):
    """Write the generated card, keeping the ``configs`` and ``dataset_info`` that ``push_to_hub`` wrote."""
    from huggingface_hub import HfApi

    api = api or HfApi(token=token)
    old = read_remote_card(repo_id, api, revision)
    data = old.data.to_dict() if old is not None else {}
    configs = [c["config_name"] for c in data.get("configs") or [] if c.get("config_name")]
    num_rows = max((m.get("num_rows", 0) for m in build_info.get("configs", {}).values()), default=None)
    data.update(card_metadata(spec, num_rows))
    body = card_text(spec, repo_id, build_info, _order(configs))
    return _commit_card(api, repo_id, data, body, commit_message, revision)


def push_benchmark(
    output_dir: str | os.PathLike,
    repo_id: str,
    configs: Iterable[str] | None = None,
    spec: BenchmarkSpec | str | None = None,
    *,
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
    skip_existing: bool = True,
    max_shard_size: str | int | None = None,
    num_proc: int | None = None,
    api=None,
    show_progress: bool = True,
) -> list[str]:
    """Push every built config of ``output_dir`` (or ``configs``) to ``repo_id``, then the dataset card.

    Args:
        skip_existing: skip configs the repository's card already declares, so an interrupted publication
            resumes (set ``False`` to re-upload).
        api: an ``HfApi``-like object for the card (tests pass a fake Hub).

    Returns:
        The configs pushed in this call.
    """
    from datasets import load_from_disk
    from huggingface_hub import HfApi

    output_dir = Path(output_dir)
    info_path = output_dir / BUILD_INFO
    if not info_path.is_file():
        raise FileNotFoundError(f"{output_dir} has no {BUILD_INFO}: build the benchmark first.")
    build_info = json.loads(info_path.read_text(encoding="utf-8"))
    if spec is None:
        spec = build_info["params"]["benchmark"]
    spec = benchmark_spec(spec)
    built = built_configs(output_dir)
    configs = _order(built if configs is None else configs)
    missing = [c for c in configs if c not in built]
    if missing:
        raise FileNotFoundError(f"Not built in {output_dir}: {missing}. Build them first.")
    if not configs:
        raise ValueError(f"Nothing to push: no built config in {output_dir}.")
    api = api or HfApi(token=token)
    done = set(remote_configs(repo_id, api, revision)) if skip_existing else set()
    todo = [c for c in configs if c not in done]
    if len(todo) < len(configs):
        logger.info("%d configs are already on %s: skipped.", len(configs) - len(todo), repo_id)
    for c in tqdm(todo, desc=f"Pushing to {repo_id}", disable=not show_progress):
        ds = load_from_disk(str(output_dir / c))
        ds.push_to_hub(
            repo_id,
            config_name=c,
            split=SPLIT,
            set_default=True if c == CLEAN else None,
            private=private,
            token=token,
            revision=revision,
            commit_message=f"Add config {c}",
            max_shard_size=max_shard_size,
            num_proc=num_proc,
        )
    push_card(repo_id, spec, build_info, api=api, token=token, revision=revision)
    return todo


def push_av_benchmark(
    built: Mapping[str, Any],
    repo_id: str,
    card: Any = None,
    *,
    private: bool | None = True,
    token: str | None = None,
    api=None,
) -> list[str]:
    """Push every config of ``built`` (config -> ``Dataset``, e.g. from :func:`build_av_benchmark`) to ``repo_id``
    (split ``test``, ``clean`` the default config), then the card (:func:`dataset_card`), keeping the ``configs``
    and ``dataset_info`` metadata that ``push_to_hub`` wrote. Private by default: see the card's licence note.

    Args:
        api: an ``HfApi``-like object for the card (tests pass a fake Hub).

    Returns:
        The configs pushed.
    """
    from huggingface_hub import HfApi

    configs = sorted(built, key=lambda c: (c != CLEAN, c))
    for config in configs:
        built[config].push_to_hub(
            repo_id, config_name=config, split=SPLIT, set_default=True if config == CLEAN else None,
            private=private, token=token, commit_message=f"Add config {config}",
        )
    if card is not None:
        api = api or HfApi(token=token)
        old = read_remote_card(repo_id, api)
        data = old.data.to_dict() if old is not None else {}
        data.update({k: v for k, v in card.data.to_dict().items() if v is not None})
        _commit_card(api, repo_id, data, card.text, "Update dataset card")
    return configs


__all__ = ["push_av_benchmark", "push_benchmark", "push_card", "read_remote_card", "remote_configs"]
