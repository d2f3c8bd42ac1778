"""What each benchmark is (the bottom of the builders): COCO-C / Flickr-C sources and licences, their config names
and ``datasets`` features; the AudioSet-O / AudioSet-D / VGGSound configs, modality pairs and features.

Config names of COCO-C / Flickr-C: ``clean``, ``image-<corruption>-<1..5>``, ``text-<corruption>-<severity>``,
``image-diverse``, ``text-diverse``. Audio-video configs: ``clean``, the -O configs of :data:`AUDIOSET_O_CONFIGS`
and the -D configs of :data:`AUDIOSET_D_CONFIGS`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from ..corruptions.image import IMAGE_CORRUPTIONS, IMAGE_SEVERITIES
from ..corruptions.text import MAX_TEXT_SEVERITY, PAPER_TEXT_SEVERITIES, TEXT_CORRUPTIONS, TEXT_SEVERITIES
from .base import CLEAN


# ------------------------------------------------------------------------------------------------ COCO-C / Flickr-C
@dataclass(frozen=True)
class BenchmarkSpec:
    """What a benchmark is built from, for the builder and the dataset card."""

    name: str
    pretty_name: str
    source_name: str
    split_file: str
    expected_images: int
    expected_captions: int
    image_license: str
    annotation_license: str
    license_id: str
    source_url: str
    citations: tuple[str, ...] = field(default_factory=tuple)
    #: The softmax temperature the papers tuned for the baselines on this set (TCR App. B.2, REST Supp. C-B).
    baseline_tau: float = 0.01
    #: The directions the papers report (``i2t`` = TR, ``t2i`` = IR).
    directions: tuple[str, ...] = ("i2t", "t2i")
    #: Card lines on ids and order; default: the Karpathy split's.
    ids_note: str = (
        "Ids are stable: `image_id` is the Karpathy `imgid`, `caption_ids` the Karpathy `sentid`s, `source_id` the "
        "COCO id (COCO) or the file stem (Flickr30K)."
    )
    #: Card lines on the split file's licence; default: the Karpathy split's.
    split_license: str = "Karpathy splits: released with \"Deep Visual-Semantic Alignments for Generating Image Descriptions\"."
    #: Extra construction bullets of the card (how the rows were read from the raw files).
    construction: tuple[str, ...] = ()
    #: A diverse query stream (REST's DQS): ``hf-tta run`` turns on REST's gradient decoupling, as REST does there.
    diverse_stream: bool = False

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "BenchmarkSpec":
        known = {f for f in cls.__dataclass_fields__}
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in known}
        return cls(**kw)


_KARPATHY = """@inproceedings{karpathy2015deep,
  title={Deep Visual-Semantic Alignments for Generating Image Descriptions},
  author={Karpathy, Andrej and Fei-Fei, Li},
  booktitle={CVPR}, year={2015}
}"""

COCO_C = BenchmarkSpec(
    name="coco-c",
    pretty_name="COCO-C (query-shift image-text retrieval)",
    source_name="MS-COCO 2014, Karpathy 5k test split",
    split_file="dataset_coco.json",
    expected_images=5000,
    expected_captions=25000,
    image_license=(
        "The COCO images come from Flickr under the Flickr Terms of Use; the COCO Consortium does not own their "
        "copyright. Use them under those terms (see https://cocodataset.org/#termsofuse)."
    ),
    annotation_license="COCO annotations (captions): Creative Commons Attribution 4.0 (CC BY 4.0).",
    license_id="cc-by-4.0",
    source_url="https://cocodataset.org",
    citations=(
        """@inproceedings{lin2014microsoft,
  title={Microsoft {COCO}: Common Objects in Context},
  author={Lin, Tsung-Yi and Maire, Michael and Belongie, Serge and Hays, James and Perona, Pietro and Ramanan, Deva and Doll{\\'a}r, Piotr and Zitnick, C. Lawrence},
  booktitle={ECCV}, year={2014}
}""",
        _KARPATHY,
    ),
)

FLICKR_C = BenchmarkSpec(
    name="flickr-c",
    pretty_name="Flickr-C (query-shift image-text retrieval)",
    source_name="Flickr30K, Karpathy 1k test split",
    split_file="dataset_flickr30k.json",
    expected_images=1000,
    expected_captions=5000,
    image_license=(
        "The Flickr30K images are Flickr photos distributed for non-commercial research and educational use only, "
        "under the Flickr Terms of Use (see the Flickr30K terms at https://shannon.cs.illinois.edu/DenotationGraph/)."
    ),
    annotation_license="Flickr30K captions: distributed by their authors for non-commercial research use.",
    license_id="other",
    source_url="https://shannon.cs.illinois.edu/DenotationGraph/",
    citations=(
        """@article{young2014image,
  title={From image descriptions to visual denotations: New similarity metrics for semantic inference over event descriptions},
  author={Young, Peter and Lai, Alice and Hodosh, Micah and Hockenmaier, Julia},
  journal={TACL}, volume={2}, pages={67--78}, year={2014}
}""",
        _KARPATHY,
    ),
)

#: The image-text benchmarks by name (``--benchmark`` of ``recipes/build_benchmarks.py``).
IMAGE_TEXT_BENCHMARKS: dict[str, BenchmarkSpec] = {COCO_C.name: COCO_C, FLICKR_C.name: FLICKR_C}


def register_spec(spec: BenchmarkSpec) -> BenchmarkSpec:
    """Add a benchmark to :data:`IMAGE_TEXT_BENCHMARKS` (the real-world sets of :mod:`.realworld` do)."""
    IMAGE_TEXT_BENCHMARKS[spec.name] = spec
    return spec


def benchmark_spec(benchmark: str | BenchmarkSpec | dict) -> BenchmarkSpec:
    """The spec of a benchmark name (``"coco-c"``, ``"flickr-c"``), a spec dict (``BenchmarkSpec.to_dict``, as a
    build records it) or the spec itself; an unknown name is a ``ValueError`` that lists the known ones."""
    if isinstance(benchmark, BenchmarkSpec):
        return benchmark
    if isinstance(benchmark, dict):
        return BenchmarkSpec.from_dict(benchmark)
    try:
        return IMAGE_TEXT_BENCHMARKS[benchmark]
    except (KeyError, TypeError):
        raise ValueError(f"Unknown benchmark {benchmark!r}; choose from {', '.join(IMAGE_TEXT_BENCHMARKS)}.") from None


# ------------------------------------------------------------------------------------------------ config names
@dataclass(frozen=True)
class ConfigSpec:
    modality: str | None  # "image", "text" or None for clean
    corruption: str | None  # a corruption name, "diverse", or None for clean
    severity: int | None

    @property
    def name(self) -> str:
        if self.modality is None:
            return CLEAN
        if self.corruption == "diverse":
            return f"{self.modality}-diverse"
        return f"{self.modality}-{self.corruption}-{self.severity}"

    @property
    def has_images(self) -> bool:
        return self.modality != "text"


def config_name(modality: str | None, corruption: str | None = None, severity: int | None = None) -> str:
    """``clean``, ``image-<name>-<severity>``, ``text-<name>-<severity>``, ``image-diverse``, ``text-diverse``."""
    return parse_config_name(ConfigSpec(modality, corruption, severity).name).name


def parse_config_name(name: str) -> ConfigSpec:
    """Check a config name and split it into modality, corruption and severity."""
    if name == CLEAN:
        return ConfigSpec(None, None, None)
    parts = name.split("-")
    if len(parts) == 2 and parts[1] == "diverse" and parts[0] in ("image", "text"):
        return ConfigSpec(parts[0], "diverse", None)
    if len(parts) == 3 and parts[0] in ("image", "text"):
        modality, corruption, sev = parts
        known = IMAGE_CORRUPTIONS if modality == "image" else TEXT_CORRUPTIONS
        allowed = IMAGE_SEVERITIES if modality == "image" else TEXT_SEVERITIES.get(corruption, ())
        if corruption in known and sev.isdigit() and int(sev) in allowed:
            return ConfigSpec(modality, corruption, int(sev))
        if corruption in known:
            raise ValueError(f"Config {name!r}: {corruption!r} has severities {list(allowed)}.")
    raise ValueError(
        f"Unknown config {name!r}: use 'clean', 'image-<corruption>-<1..5>', 'text-<corruption>-<severity>', "
        f"'image-diverse' or 'text-diverse' (image corruptions: {list(IMAGE_CORRUPTIONS)}; text corruptions: "
        f"{list(TEXT_CORRUPTIONS)})."
    )


def text_severities(mode: str | Sequence[int] = "max") -> dict[str, tuple[int, ...]]:
    """Severities per text corruption: ``"max"`` (char/word 7, sentence 1: the benchmark tables), ``"paper"`` (the
    released TCR data: char 1..7, word 6..7, sentence 1), ``"all"`` (char/word 1..7), or a list (clipped to each
    corruption's range)."""
    if mode == "max":
        return {n: (MAX_TEXT_SEVERITY[n],) for n in TEXT_CORRUPTIONS}
    if mode == "paper":
        return dict(PAPER_TEXT_SEVERITIES)
    if mode == "all":
        return dict(TEXT_SEVERITIES)
    if isinstance(mode, str):
        raise ValueError(f"text severities must be 'max', 'paper', 'all' or a list; got {mode!r}.")
    return {n: tuple(s for s in mode if s in TEXT_SEVERITIES[n]) or (MAX_TEXT_SEVERITY[n],) for n in TEXT_CORRUPTIONS}


def default_configs(
    image_corruptions: Iterable[str] | None = None,
    image_severities: Iterable[int] = IMAGE_SEVERITIES,
    text_corruptions: Iterable[str] | None = None,
    text_severity_mode: str | Sequence[int] = "max",
    diverse: bool = True,
    clean: bool = True,
) -> list[str]:
    """The config names of a full build: clean, 16x5 image configs, 15 text configs (at maximum severity by
    default) and the two diverse configs."""
    names = [CLEAN] if clean else []
    image_corruptions = list(IMAGE_CORRUPTIONS if image_corruptions is None else image_corruptions)
    names += [f"image-{n}-{s}" for n in image_corruptions for s in image_severities]
    sev = text_severities(text_severity_mode)
    text_corruptions = list(TEXT_CORRUPTIONS if text_corruptions is None else text_corruptions)
    names += [f"text-{n}-{s}" for n in text_corruptions for s in sev[n]]
    if diverse:
        names += ["image-diverse", "text-diverse"]
    for n in names:
        parse_config_name(n)
    return names


# ------------------------------------------------------------------------------------------------ features
#: Optional columns of records that carry them (:class:`~.karpathy.KarpathyImage` ``group`` / ``domain``).
EXTRA_COLUMNS = ("group", "domain")


def image_features(extra: Sequence[str] = ()):
    from datasets import Features, Image, List, Value

    return Features(
        {
            **{c: Value("string") for c in extra},
            "image_id": Value("int64"),
            "source_id": Value("string"),
            "filename": Value("string"),
            "image": Image(),
            "captions": List(Value("string")),
            "caption_ids": List(Value("int64")),
            "corruption": Value("string"),
            "severity": Value("int8"),
        }
    )


def text_features(extra: Sequence[str] = ()):
    from datasets import Features, List, Value

    return Features(
        {
            **{c: Value("string") for c in extra},
            "image_id": Value("int64"),
            "source_id": Value("string"),
            "filename": Value("string"),
            "captions": List(Value("string")),
            "clean_captions": List(Value("string")),
            "caption_ids": List(Value("int64")),
            "corruption": List(Value("string")),
            "severity": List(Value("int8")),
        }
    )




# ------------------------------------------------------------------------------------------------ audio-video
#: Test pairs of REST's protocol (video-audio, 1-to-1).
NUM_PAIRS = 3000
#: AudioSet-O: config -> (corrupted modality, corruption categories in segment order).
AUDIOSET_O_CONFIGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "video_noise_blur": ("video", ("noise", "blur")),
    "video_noise_digital": ("video", ("noise", "digital")),
    "video_blur_digital": ("video", ("blur", "digital")),
    "video_noise_blur_digital": ("video", ("noise", "blur", "digital")),
    "audio_noise_weather": ("audio", ("noise", "weather")),
}
#: AudioSet-D: config -> corrupted modality (every segment draws from all subtypes).
AUDIOSET_D_CONFIGS: dict[str, str] = {"video_diverse": "video", "audio_diverse": "audio"}
#: The audio-video benchmarks by name: their configs.
AV_BENCHMARKS: dict[str, tuple[str, ...]] = {
    "audioset-o": ("clean", *AUDIOSET_O_CONFIGS),
    "audioset-d": ("clean", *AUDIOSET_D_CONFIGS),
    "vggsound": ("clean",),
}
#: The (query, gallery) modality pairs of the audio-video benchmarks (the grid runner names them a2t, t2a, ...).
AV_MODALITY_PAIRS: tuple[tuple[str, str], ...] = (
    ("audio", "text"),
    ("text", "audio"),
    ("video", "text"),
    ("text", "video"),
    ("video", "audio"),
    ("audio", "video"),
)


def parse_direction(direction: str | Sequence[str]) -> tuple[str, str]:
    """``"video->audio"``, ``"video2audio"``, ``"video_to_audio"`` or ``("video", "audio")``."""
    if isinstance(direction, str):
        parts = re.split(r"\s*(?:->|2|_to_|→)\s*", direction.strip().lower())
    else:
        parts = list(direction)
    pair = tuple(parts)
    if pair not in AV_MODALITY_PAIRS:
        raise ValueError(f"Unknown direction {direction!r}; choose from {[f'{q}->{g}' for q, g in AV_MODALITY_PAIRS]}.")
    return pair  # type: ignore[return-value]


def av_features(config: str):
    """The ``datasets`` features of an audio-video config (``clean``, ``video_*`` or ``audio_*``)."""
    from datasets import Features, Image, List, Value

    if config == "clean":
        return Features(
            {
                "id": Value("string"),
                "video": List(Image()),
                "audio": Value("binary"),
                "sampling_rate": Value("int32"),
                "text": Value("string"),
            }
        )
    common = {"id": Value("string"), "corruptions": List(Value("string")), "segments": List(List(Value("int32")))}
    if config.startswith("video"):
        return Features({**common, "video": List(Image()), "severity": List(Value("int32"))})
    return Features({**common, "audio": Value("binary"), "sampling_rate": Value("int32"), "snr_db": List(Value("float32"))})



__all__ = [
    "order_configs",
    "AUDIOSET_D_CONFIGS",
    "AUDIOSET_O_CONFIGS",
    "AV_BENCHMARKS",
    "AV_MODALITY_PAIRS",
    "BenchmarkSpec",
    "COCO_C",
    "ConfigSpec",
    "EXTRA_COLUMNS",
    "FLICKR_C",
    "IMAGE_TEXT_BENCHMARKS",
    "NUM_PAIRS",
    "av_features",
    "config_name",
    "default_configs",
    "image_features",
    "parse_config_name",
    "parse_direction",
    "register_spec",
    "text_features",
    "text_severities",
]


def order_configs(configs: Iterable[str]) -> list[str]:
    """clean first, then image, then text configs (the order of the card and of the Hub viewer)."""
    def key(c: str):
        spec = parse_config_name(c)
        return ({None: 0, "image": 1, "text": 2}[spec.modality], spec.corruption == "diverse", c)

    return sorted(configs, key=key)
