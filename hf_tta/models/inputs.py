"""What one input tensor of a modality must look like (:class:`InputSpec`), and the check that enforces it.

Adapters declare a spec per input key (:meth:`~hf_tta.models.base.ModelAdapter.input_specs`, built from the model's
config); :func:`check_input` applies it before anything runs, so that a user's mistake (raw ``uint8`` images, a
missing batch dimension, a grey-scale batch for an RGB tower, token ids of another tokenizer) is one clear error
naming the fix instead of an error from deep inside the model, or, worse, a silent adaptation on wrong inputs.

Pixel values are normalised (``(x / 255 - mean) / std``: a few units at most); a float tensor with values beyond
:data:`PIXEL_MAX_ABS` skipped the image processor (raw 0..255 pixels cast to float) and is refused.

Floating-point features of another dtype than the model's (e.g. ``float64`` pixels for a ``float32`` model, or
``float32`` pixels for a ``bfloat16`` model) are cast once, here, to the model's dtype: the processor's output is
``float32`` whatever the model's dtype, so refusing would break the ordinary bf16 recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FEATURES, IDS, MASK = "features", "ids", "mask"
# |pixel| bound: normalised pixels of every HF image processor lie within about +-3 (CLIP's mean/std give
# [-1.79, 2.15], ImageNet's [-2.12, 2.64], SigLIP's [-1, 1]); raw 0..255 pixels reach far beyond.
PIXEL_MAX_ABS = 20.0
KINDS = (FEATURES, IDS, MASK)


@dataclass(frozen=True)
class InputSpec:
    """The contract of one input tensor.

    Example:
        >>> spec = InputSpec(FEATURES, layout=("B", "C", "H", "W"), sizes=((1, 3, "vision_config.num_channels=3"),))
        >>> spec.rank
        4
    """

    kind: str = field(metadata={"help": "'features' (floating point: pixels, spectrograms), 'ids' (integer token ids) or 'mask'."})
    layout: tuple[str, ...] | None = field(
        default=None, metadata={"help": "Axis names, e.g. ('B', 'C', 'H', 'W'); their number is the required rank. None = any rank."}
    )
    sizes: tuple[tuple[int, int, str], ...] = field(
        default=(), metadata={"help": "(axis, required size, where the size comes from, e.g. 'vision_config.num_channels=3')."}
    )
    vocab_size: int | None = field(default=None, metadata={"help": "Ids must lie in [0, vocab_size) (None = unchecked)."})
    vocab_source: str = field(default="", metadata={"help": "Where vocab_size comes from (named in the error)."})
    processor: str = field(default="the model's processor", metadata={"help": "What produces this input (named in the errors)."})
    description: str = field(default="inputs", metadata={"help": "What the tensor holds, e.g. 'normalised pixel values'."})
    like: str | None = field(default=None, metadata={"help": "Another input key this one must have the shape of."})
    required: bool = field(default=False, metadata={"help": "Refuse the batch when this key is absent."})
    max_abs: float | None = field(
        default=None,
        metadata={"help": "Refuse floating-point features with a larger |value| (pixels that skipped normalisation)."},
    )
    image_size: tuple[int, int] | None = field(
        default=None, metadata={"help": "(H, W) the last two axes must have: the size a tower's position embeddings fix (None = any)."}
    )
    image_size_source: str = field(default="", metadata={"help": "Where image_size comes from, e.g. 'vision_config.image_size=224'."})
    resize_with: str = field(
        default="", metadata={"help": "The call that loads the processor resizing to image_size (named in the error; else `processor`)."}
    )

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"InputSpec.kind must be one of {list(KINDS)}, got {self.kind!r}.")

    @property
    def rank(self) -> int | None:
        return None if self.layout is None else len(self.layout)


def check_input(
    modality: str, name: str, value: torch.Tensor, spec: InputSpec, dtype: torch.dtype | None, inputs: dict
) -> torch.Tensor:
    """Raise a ``ValueError``/``TypeError`` naming the fix unless ``value`` meets ``spec``; return it (features cast
    once to ``dtype``). ``inputs`` holds the modality's other (already selected) inputs, for ``spec.like``."""
    where = f"{modality} input {name!r}"
    if spec.kind == FEATURES:
        if not value.is_floating_point():
            raise TypeError(
                f"{where} has dtype {value.dtype}, but the model takes floating-point {spec.description}, not raw "
                f"integer/bool data: run the raw {modality} through {spec.processor} first."
            )
    elif spec.kind == IDS:
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(
                f"{where} has dtype {value.dtype}: token ids must be integers (torch.long, as {spec.processor} returns them)."
            )
    if spec.rank is not None and value.dim() != spec.rank:
        hint = " (one item? add the batch dimension with .unsqueeze(0))" if value.dim() == spec.rank - 1 else ""
        raise ValueError(
            f"{where} must have shape ({', '.join(spec.layout)}), {spec.rank} dimensions, as {spec.processor} returns it; "
            f"got {tuple(value.shape)}{hint}."
        )
    for axis, size, source in spec.sizes:
        if -value.dim() <= axis < value.dim() and value.shape[axis] != size:
            axis_name = f" ({spec.layout[axis]})" if spec.layout is not None else ""
            raise ValueError(
                f"{where} has size {value.shape[axis]} on axis {axis}{axis_name} but the model expects {size} ({source}); "
                f"got shape {tuple(value.shape)}. Prepare it with {spec.processor}."
            )
    if spec.image_size is not None and value.dim() >= 2 and tuple(value.shape[-2:]) != tuple(spec.image_size):
        (h, w), (eh, ew) = value.shape[-2:], spec.image_size
        raise ValueError(
            f"{modality} inputs are {h}x{w} images but the model expects {eh}x{ew} ({spec.image_size_source}): preprocess "
            f"them with the model's processor ({spec.resize_with or spec.processor}), which resizes them."
        )
    if spec.like is not None and spec.like in inputs and value.shape != inputs[spec.like].shape:
        raise ValueError(
            f"{where} must have the shape of {spec.like!r}, {tuple(inputs[spec.like].shape)}; got {tuple(value.shape)}."
        )
    if spec.kind == IDS and spec.vocab_size is not None and value.numel():
        if bool(((value < 0) | (value >= spec.vocab_size)).any()):  # one device sync per batch on the happy path
            low, high = int(value.min()), int(value.max())
            raise ValueError(
                f"{where} holds ids in [{low}, {high}] but the vocabulary has {spec.vocab_size} tokens "
                f"({spec.vocab_source}): tokenise with this model's tokenizer ({spec.processor})."
            )
    if spec.kind == FEATURES and spec.max_abs is not None and value.numel() and value.device.type != "meta":
        peak = value.detach().abs().amax()
        # one device sync per batch (as the ids' range check); NaN/inf are left to the wrapper's non-finite check
        if bool((peak > spec.max_abs) & torch.isfinite(peak)):
            raise ValueError(
                f"{where} holds values up to {float(peak):.4g}, but {spec.description} lie within a few units "
                f"(|x| <= {spec.max_abs:g} accepted): raw 0..255 pixels? Prepare the {modality} with {spec.processor}, "
                "which rescales and normalises them."
            )
    if spec.kind == FEATURES and dtype is not None and value.dtype != dtype:
        value = value.to(dtype)  # cast once, at the boundary (see the module docstring)
    return value
