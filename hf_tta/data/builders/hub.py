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
from .card import card_metadata, card_text, local_card
from .specs import BenchmarkSpec, benchmark_spec, order_configs

logger = logging.getLogger(__name__)


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


#: Commit a card (YAML data + Markdown body): public name for the other publishers (:mod:`.composed_hub`).
commit_card = _commit_card


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
    body = card_text(spec, repo_id, build_info, order_configs(configs))
    return _commit_card(api, repo_id, data, body, commit_message, revision)


PUSH_PLAN = "push_plan.json"


def _num_shards(ds, max_shard_size: str | int | None, num_proc: int | None) -> int:
    """How many parquet shards ``Dataset.push_to_hub`` writes (datasets 5.2: ``int(nbytes / max_shard_size) + 1``,
    at least ``num_proc``)."""
    from datasets import config
    from datasets.utils.py_utils import convert_file_size_to_int

    estimate = getattr(ds, "_estimate_nbytes", None)  # what push_to_hub sizes shards by (embedded image bytes included)
    nbytes = estimate() if estimate is not None else ds.data.nbytes
    return max(int(nbytes / convert_file_size_to_int(max_shard_size or config.MAX_SHARD_SIZE)) + 1, num_proc or 1)


def plan_push(
    output_dir: Path, repo_id: str, todo: list[str], done: list[str], *,
    private: bool | None, revision: str | None, max_shard_size: str | int | None, num_proc: int | None,
    remote_state: str,
) -> dict:
    """The commits :func:`push_benchmark` makes: one per config (its parquet shards, as ``push_to_hub`` names them,
    and the card's ``configs`` entry), then the card (``README.md``)."""
    from datasets import load_from_disk

    commits = []
    for c in todo:
        ds = load_from_disk(str(output_dir / c))
        n = _num_shards(ds, max_shard_size, num_proc)
        if n > len(ds):  # push_to_hub would fail on an empty shard: say so now
            raise ValueError(f"{c}: max_shard_size={max_shard_size} gives {n} shards for {len(ds)} rows; raise it.")
        files = [
            {"path_in_repo": f"{c}/{SPLIT}-{i:05d}-of-{n:05d}.parquet", "num_rows": len(ds.shard(n, i, contiguous=True))}
            for i in range(n)
        ]
        commits.append({
            "commit_message": f"Add config {c}", "config": c, "source": str(output_dir / c),
            "files": files + [{"path_in_repo": "README.md", "update": f"configs: {c} -> {c}/{SPLIT}-*"}],
        })
    commits.append({"commit_message": "Update dataset card", "files": [{"path_in_repo": "README.md", "preview": "push_plan.README.md"}]})
    return {
        "repo_id": repo_id, "repo_type": "dataset", "private": private, "revision": revision, "remote_state": remote_state,
        "skipped_existing": done, "configs": todo, "num_rows": sum(f["num_rows"] for c in commits for f in c["files"] if "num_rows" in f),
        "commits": commits,
    }


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
    dry_run: bool = False,
) -> list[str]:
    """Push every built config of ``output_dir`` (or ``configs``) to ``repo_id``, then the dataset card.

    Args:
        skip_existing: skip configs the repository's card already declares, so an interrupted publication
            resumes (set ``False`` to re-upload).
        api: an ``HfApi``-like object for the card (tests pass a fake Hub).
        dry_run: upload nothing; write the commit plan to ``output_dir/push_plan.json`` (every commit, every file
            with its path in the repository and its rows) and the card to ``output_dir/push_plan.README.md``. The
            repository is read (which configs it has) when it can be reached; offline, every config is planned.

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
    if spec is None:  # a records build (pairs, real-world sets) records its spec; COCO-C / Flickr-C their name
        spec = build_info["params"].get("spec") or build_info["params"]["benchmark"]
    spec = benchmark_spec(spec)
    built = built_configs(output_dir)
    configs = order_configs(built if configs is None else configs)
    missing = [c for c in configs if c not in built]
    if missing:
        raise FileNotFoundError(f"Not built in {output_dir}: {missing}. Build them first.")
    if not configs:
        raise ValueError(f"Nothing to push: no built config in {output_dir}.")
    api = api or HfApi(token=token)
    remote_state = "read" if skip_existing else "not read (skip_existing=False)"
    try:
        done = set(remote_configs(repo_id, api, revision)) if skip_existing else set()
    except Exception as err:  # noqa: BLE001 - a dry run offline plans every config
        if not dry_run:
            raise
        done, remote_state = set(), f"unreachable ({type(err).__name__}): every config planned"
    todo = [c for c in configs if c not in done]
    if dry_run:
        plan = plan_push(output_dir, repo_id, todo, sorted(done & set(configs)), private=private,
                         revision=revision, max_shard_size=max_shard_size, num_proc=num_proc, remote_state=remote_state)
        (output_dir / PUSH_PLAN).write_text(json.dumps(plan, indent=1), encoding="utf-8")
        (output_dir / "push_plan.README.md").write_text(local_card(spec, repo_id, build_info, configs, f"{{config}}/{SPLIT}-*"), encoding="utf-8")
        logger.info("Dry run: %d commits planned in %s; nothing uploaded.", len(plan["commits"]), output_dir / PUSH_PLAN)
        return todo
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


__all__ = ["PUSH_PLAN", "commit_card", "plan_push", "push_av_benchmark", "push_benchmark", "push_card", "read_remote_card", "remote_configs"]
