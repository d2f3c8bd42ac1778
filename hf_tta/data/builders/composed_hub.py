"""Loading, dataset card and Hub publishing of the composed sets built by :mod:`.composed` (FIQ-O/-D, CIRR-O/-D).

Example (with a ``Blip2Processor`` and a ``TTAWrapper(blip2, TTAConfig(query_modality="composed"))`` ``tta``)::

    split = load_composed_split("build/cirr", "noise_char")
    gallery = tta.encode_gallery(split.gallery_inputs(processor))
    scores = torch.cat([tta.adapt_step(b, gallery).scores for b in split.query_inputs(processor, batch_size=32)])
    print(split.evaluate(scores))    # CIRR: R@1/5/10/50, Recall_subset@1/2/3 (reference removed); FIQ: R@10/R@50
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from .base import BUILD_INFO, SPLIT, built_configs
from .composed import COMPOSED_CONFIGS, GALLERY, O_CONFIGS
from .loading import LazyImages, LazyItems, load_any_config
from .specs import benchmark_spec


def _composed_item(row: dict) -> dict:
    return {"image": row["image"].convert("RGB"), "text": row["text"]}


class LazyComposed(LazyItems):
    """Composed queries ``{"image": PIL image, "text": str}``, decoded when indexed."""

    def __init__(self, dataset):
        self._ds, self.decode, self.column = dataset.select_columns(["image", "text"]), _composed_item, None

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.decode(self._ds[int(index)])


def composed_inputs(items: Sequence[dict], processor, **kwargs) -> dict:
    """``processor(images=references, text=modifications)``: ``{"pixel_values", "input_ids", "attention_mask"}``."""
    items = list(items)
    return dict(processor(images=[i["image"] for i in items], text=[i["text"] for i in items], return_tensors="pt",
                          **{"padding": True, "truncation": True, **kwargs}))


@dataclass
class ComposedSplit:
    """The composed queries of one config, the gallery of target images and each query's target, reference and
    image set as gallery positions (``-1``: the reference is not in the gallery)."""

    config: str
    kind: str  # "cirr" or "fashioniq"
    queries: Sequence
    gallery: Sequence
    targets: list[int]
    references: list[int]
    members: list[list[int]]

    task = "c2i"
    query_modality = "composed"
    gallery_modality = "image"

    @property
    def relevant(self) -> list[list[int]]:
        return [[t] for t in self.targets]

    def __len__(self) -> int:
        return len(self.queries)

    def query_inputs(self, processor, batch_size: int = 32, **kwargs) -> Iterator[dict]:
        for start in range(0, len(self.queries), batch_size):
            yield composed_inputs(self.queries[start : start + batch_size], processor, **kwargs)

    def gallery_inputs(self, processor, batch_size: int = 256) -> list[dict]:
        return [dict(processor(images=list(self.gallery[s : s + batch_size]), return_tensors="pt")) for s in range(0, len(self.gallery), batch_size)]

    def evaluate(self, scores) -> dict[str, float]:
        """REST's metrics: CIRR R@1/5/10/50 and Recall_subset@1/2/3 (reference removed); FIQ R@10/R@50."""
        from ...metrics.composed import FIQ_KS, cirr_metrics, composed_recall

        n = scores.shape[0]
        if self.kind == "cirr":
            members = self.members[:n] if all(self.members[:n]) else None
            return cirr_metrics(scores, self.targets[:n], self.references[:n], members)
        return composed_recall(scores, self.targets[:n], FIQ_KS)


def load_composed_split(source: Any, config: str, split: str = SPLIT) -> ComposedSplit:
    """Queries of ``config`` (``clean``, an -O config such as ``noise_char``, ``diverse``) against the ``gallery``
    config, from a build folder, a local Hub-layout folder or a Hub id."""
    if config not in COMPOSED_CONFIGS or config == GALLERY:
        raise ValueError(f"Unknown composed query config {config!r}; choose from clean, {', '.join(O_CONFIGS)}, diverse.")
    gallery = load_any_config(source, GALLERY, split)
    ds = load_any_config(source, config, split)
    pos = {n: i for i, n in enumerate(gallery.select_columns(["name"])[:]["name"])}
    meta = ds.select_columns(["target", "reference", "members", "category"])[:]
    missing = sorted({t for t in meta["target"] if t not in pos})
    if missing:
        raise ValueError(f"Targets {missing[:3]} of {config!r} are not in the gallery config: build them together.")
    kind = "cirr" if meta["category"] and meta["category"][0] == "cirr" else "fashioniq"
    return ComposedSplit(
        config, kind, LazyComposed(ds), LazyImages(gallery), [pos[t] for t in meta["target"]],
        [pos.get(r, -1) for r in meta["reference"]], [[pos[m] for m in ms if m in pos] for ms in meta["members"]],
    )


def is_composed_build(source: Any) -> bool:
    """Whether ``source`` is a local folder built by :class:`~.composed.ComposedBuilder`."""
    path = Path(str(source)) / BUILD_INFO
    return path.is_file() and json.loads(path.read_text(encoding="utf-8")).get("params", {}).get("kind") == "composed"


def composed_card_text(build_info: dict, repo_id: str, configs: Sequence[str]) -> str:
    """The card body: sources and licences, the configs and exactly how each was corrupted, the metrics."""
    p = build_info["params"]
    spec = benchmark_spec(p["spec"])
    rep = build_info.get("source_report") or {}
    ireps, treps = p["image_representatives"], p["text_representatives"]
    rows = [f"| `{c}` | reference image: {ireps[c.split('_')[0]]} (severity 5); text: {treps[c.split('_')[1]]} (maximum severity) |"
            for c in configs if c in O_CONFIGS]
    metric = ("R@1/5/10/50 and Recall_subset@1/2/3, each query's reference image removed from its ranking"
              if spec.name == "cirr" else "R@10 and R@50 per category (REST reports the mean over dress, shirt, toptee)")
    return "\n".join([
        f"# {spec.pretty_name}", "",
        f"Composed image retrieval under query shift (REST Tables III, VI, A.8), built from the user's {spec.source_name} files with "
        "`hf_tta.data.builders.composed`. A query is a reference image plus a modification text; the gallery (config "
        "`gallery`) is the clean target images.", "",
        "## Configs", "", "| config | construction |", "|---|---|",
        "| `gallery` | the clean target images (`name`, `image`) |",
        "| `clean` | the clean composed queries (reference `image`, modification `text`, `target` name) |", *rows,
        f"| `diverse` | each query its own draw of an image corruption from {len(p['image_pool'])} and a text corruption from "
        f"{len(p['text_pool'])} (REST's -D) |" if "diverse" in configs else "", "",
        f"Build: seed {p['seed']}; every draw is a function of the seed, the config and `query_id`. "
        f"{rep.get('num_queries', '?')} queries, {rep.get('num_gallery', '?')} gallery images; "
        f"{len(rep.get('missing', []))} missing images left out.", "",
        "Representative subtypes: REST names Gaussian noise and OCR; Word = synonym replacement and Sent = back-translation are "
        "read from Table A.1; Blur, Weather and Digital are this library's choice (defocus blur, snow, contrast).", "",
        f"## Metrics\n\n{metric}. REST adapts with batch size 32.", "",
        "## Usage", "", "```python", "from hf_tta.data.builders.composed_hub import load_composed_split",
        f'split = load_composed_split("{repo_id}", "noise_char")', "```", "",
        "## Licences", "", f"- Images: {spec.image_license}", f"- Annotations: {spec.annotation_license}",
        "- The corruptions add no new content; derived data follows the licences of its sources.", "",
        "## Citations", "", "```bibtex", "\n\n".join(spec.citations), "```", "",
    ])


def push_composed(output_dir: str | os.PathLike, repo_id: str, *, private: bool | None = None, token: str | None = None,
                  api=None, show_progress: bool = True) -> list[str]:
    """Push every built config of a composed build (``clean`` first, the default config), then the card; returns the
    configs in the order pushed."""
    from datasets import load_from_disk
    from huggingface_hub import HfApi

    from .hub import commit_card, read_remote_card

    output_dir = Path(output_dir)
    info = json.loads((output_dir / BUILD_INFO).read_text(encoding="utf-8"))
    built = built_configs(output_dir)
    configs = [c for c in ("clean", *COMPOSED_CONFIGS) if c in built]
    configs = list(dict.fromkeys(configs))  # clean first: it becomes the default config
    if not configs:
        raise ValueError(f"Nothing to push: no built config in {output_dir}.")
    for c in configs:
        load_from_disk(str(output_dir / c)).push_to_hub(repo_id, config_name=c, split=SPLIT, set_default=True if c == "clean" else None,
                                                      private=private, token=token, commit_message=f"Add config {c}")
    api = api or HfApi(token=token)
    old = read_remote_card(repo_id, api)
    data = old.data.to_dict() if old is not None else {}
    spec = benchmark_spec(info["params"]["spec"])
    data.update({"pretty_name": spec.pretty_name, "license": spec.license_id, "language": ["en"],
                 "tags": ["hf_tta", "test-time-adaptation", "query-shift", "composed-image-retrieval"],
                 "hf_tta": {"benchmark": spec.name, "baseline_tau": spec.baseline_tau, "directions": list(spec.directions), "kind": "composed"}})
    commit_card(api, repo_id, data, composed_card_text(info, repo_id, configs), "Update dataset card")
    return configs


__all__ = ["ComposedSplit", "LazyComposed", "composed_card_text", "composed_inputs", "is_composed_build", "load_composed_split", "push_composed"]
