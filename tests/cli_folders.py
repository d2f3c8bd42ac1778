"""Checkpoint and benchmark folders as a user has them: tiny models saved with ``save_pretrained`` together with their
processors (a BERT tokenizer from a small vocab file + a BLIP image processor), and a COCO-C-style benchmark with one
``save_to_disk`` folder per config (the layout :mod:`hf_tta.data.builders` writes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tiny_models import make_model

WORDS = ["photo", "of", "a", "the", "red", "blue", "green", "cat", "dog", "car", "tree", "house", "boat", "bird"]


def save_retrieval_checkpoint(name: str, folder: Path, model_class: str | None = None) -> Path:
    """``make_model(name)`` (``blip``: BlipForImageTextRetrieval, ``blip2``: Blip2ForImageTextRetrieval with
    ``use_qformer_text_input=True``) and its processor, saved to ``folder``; ``model_class`` (e.g. ``BlipModel``)
    saves that class of the same config instead."""
    import transformers
    from transformers import BertTokenizer, Blip2Processor, BlipImageProcessor, BlipProcessor

    folder.mkdir(parents=True, exist_ok=True)
    vocab = folder.parent / f"{folder.name}-vocab.txt"  # [CLS]=0, [PAD]=1, [SEP]=2: the tiny configs' bos/pad/eos ids
    vocab.write_text("\n".join(["[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]", *WORDS, *map(str, range(10))]) + "\n")
    tokenizer = BertTokenizer(vocab=str(vocab))
    images = BlipImageProcessor(size={"height": 32, "width": 32})
    processor = (Blip2Processor if name == "blip2" else BlipProcessor)(image_processor=images, tokenizer=tokenizer)
    model = make_model(name)
    if model_class is not None:
        model = getattr(transformers, model_class)(model.config)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def save_benchmark(folder: Path, n: int = 8, corruptions=("fog",), captions: list[list[str]] | None = None) -> Path:
    """A COCO-C-style benchmark of ``n`` random images with 2 captions each (or one image per list of ``captions``):
    ``clean``, ``image-<c>-5`` per corruption and ``text-ocr-7``."""
    from datasets import Dataset
    from PIL import Image

    from hf_tta.data.builders.benchmark import image_features, text_features

    n = len(captions) if captions is not None else n
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)) for _ in range(n)]
    caps = captions or [[f"photo of a {WORDS[4 + i % 3]} {WORDS[7 + i % 7]} {i}", f"the {WORDS[7 + i % 7]} {i}"] for i in range(n)]
    first = np.cumsum([0] + [len(c) for c in caps])
    base = dict(image_id=list(range(n)), source_id=[str(i) for i in range(n)], filename=[f"{i}.jpg" for i in range(n)],
                captions=caps, caption_ids=[list(range(int(first[i]), int(first[i + 1]))) for i in range(n)])
    configs = {"clean": Dataset.from_dict({**base, "image": images, "corruption": ["none"] * n, "severity": [0] * n},
                                          features=image_features())}
    for c in corruptions:
        configs[f"image-{c}-5"] = Dataset.from_dict({**base, "image": images[::-1], "corruption": [c] * n, "severity": [5] * n},
                                                    features=image_features())
    configs["text-ocr-7"] = Dataset.from_dict({**base, "clean_captions": caps, "corruption": [["ocr"] * len(c) for c in caps],
                                               "severity": [[7] * len(c) for c in caps]}, features=text_features())
    for name, ds in configs.items():
        ds.save_to_disk(str(folder / name))
    return folder
