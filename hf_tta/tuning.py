"""What a wrapper adapts and how fast: the PEFT wrapping of the query tower, per-group learning rates, and the pull
towards the source weights.

``TTAConfig.tuning`` (a :class:`~hf_tta.TuningConfig`) picks with its ``method`` how the selected modules
(``target_modules``, default: the query tower's normalisation layers) adapt:

* ``"ln"`` (default, every seed's methods): every parameter of the selected modules, in place: the model keeps its
  modules and state-dict keys, its own LayerNorm parameters hold the adapted values (so ``model.save_pretrained``
  saves the adapted model) and the source values are kept in the wrapper's :class:`~hf_tta.state.AdapterState`;
  :func:`source_values` computes with them (the wrapper's ``disabled()``).
* ``"bias"``: only their biases (BitFit, Ben Zaken et al. 2022), in place as ``"ln"``; without ``target_modules``,
  every module of the query tower that has a bias.
* ``"lora"``: a LoRA update ``ΔW = (alpha / r) B A`` of rank ``lora_rank`` on each selected ``Linear`` / ``Conv``
  (PEFT's LoRA, ``lora_alpha = r``, so the scale is 1; ``B`` starts at zero, so the wrapped model computes exactly as
  the source; ``A``'s initialisation is drawn from ``TTAConfig.seed``). Depth-wise convolutions (ConvNeXt's
  ``dwconv``) are refused by PEFT unless the rank is a multiple of their groups.

``lr_multipliers`` maps regular expressions (``re.search`` on the adapted parameter's name) to factors on the learning
rate (the first match wins, others keep 1), so deeper parameters can move slower than the LayerNorms.

``anchor_weight`` adds L2-SP's pull towards the source (Li et al., ICML 2018, Eq. 3 with the starting point as the
reference): ``(alpha / 2) * sum_i ||theta_i - theta_i^0||^2`` over the adapted tensors, where for a LoRA layer the
distance is that of its effective weight, ``||ΔW||_F^2``. It is added to every step's loss (:class:`Anchor`).

``TTAConfig.consistency`` (a :class:`~hf_tta.ConsistencyConfig`) adds a pull towards the source model's
*predictions* instead of its weights (:class:`SourceConsistency`): ``weight * mean_i KL(p^0_i || p_i)``, where ``p^0_i``
and ``p_i`` are the source's and the adapted model's softmax at ``temperature`` over query ``i``'s ``top_k`` items of
highest source score (the top-k the safety layer compares; issue 29's "consistency with the source on the top-k").
A query the source is sure of keeps its answer; where the source is unsure the target is flat, and the pull then also
resists the adapted model becoming sure. On the emoji benchmark it cost TCR's gain at every weight tried (0.01 to 10;
``model_cards/emoji-benchmark-results-v3.md``, issue 29's round 3), so it is off by default and in no preset.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Mapping

import torch
from torch import nn

from .gradient_decoupling import prediction_kl
from .models.base import ModelAdapter, resolve_target_modules
from .models.checkpointing import enable_gradient_checkpointing
from .models.peft_interop import peft_layers
from .objectives.base import ObjectiveInputs

if TYPE_CHECKING:
    from peft import PeftModel

logger = logging.getLogger(__name__)

# Models a wrapper adapts in place (``"ln"``, ``"bias"``): their LayerNorms hold that wrapper's adapted values, so a
# second wrapper would take them for the source. A weak set: it keeps no model alive.
_WRAPPED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


@dataclass
class Targets:
    """The wrapped model's PEFT handle (LoRA only; ``None`` when the model's own parameters adapt in place), the
    adapted tensors by name and the modules they live in."""

    peft_model: PeftModel | None
    params: dict[str, nn.Parameter]
    modules: list[str]


def bias_modules(adapter: ModelAdapter, modality: str) -> list[str]:
    """Every module of ``modality``'s tower that owns a ``bias`` parameter (BitFit's default selection)."""
    return [
        name for name, module in adapter.model.named_modules()
        if name and isinstance(getattr(module, "bias", None), nn.Parameter) and modality in adapter.tower_of(name)
    ]


def wrap_targets(adapter: ModelAdapter, modality: str, config) -> Targets:
    """Make exactly what ``config`` (a :class:`~hf_tta.TTAConfig`) selects trainable: the selected modules' own
    parameters (``"ln"``, ``"bias"``; the model's structure and state-dict keys unchanged) or PEFT LoRA layers around
    them (``"lora"``). Everything else is frozen; the model is left in eval mode."""
    model = adapter.model
    if model in _WRAPPED or peft_layers(model):
        raise ValueError(
            "This model is already wrapped by a TTAWrapper (or carries PEFT adapter layers): pass a fresh source "
            "model (copy.deepcopy(model) starts from its current values), or use the existing wrapper's load_state(path)."
        )
    tuned = config.tuning  # a TuningConfig
    target = tuned.target_modules
    if tuned.method == "lora" and target is None:
        raise ValueError("tuning='lora' needs target_modules naming the Linear/Conv layers to adapt, e.g. "
                         "target_modules='.*vision_model.*pwconv[12]'.")
    if tuned.method == "bias" and target is None:
        target = bias_modules(adapter, modality)
    modules = resolve_target_modules(adapter, modality, target, tuned.exclude_modules)
    flags = [(p, p.requires_grad) for p in model.parameters()]
    if tuned.method == "lora":
        peft_model = _wrap_lora(model, modules, config)
    else:  # in place: only requires_grad changes
        peft_model = None
        model.requires_grad_(False)
        for name in modules:
            model.get_submodule(name).requires_grad_(True)
    if tuned.method == "bias":
        for name, p in model.named_parameters():
            if p.requires_grad and not name.endswith(".bias"):
                p.requires_grad_(False)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not params:
        for p, flag in flags:
            p.requires_grad_(flag)
        raise ValueError(f"tuning={tuned.method!r} leaves nothing to adapt in {modules[:3]}: select other target_modules.")
    model.eval()
    if config.run.gradient_checkpointing:  # after every eval(): it marks the tower's layers as training
        enable_gradient_checkpointing(adapter, modality)
    _WRAPPED.add(model)
    return Targets(peft_model, params, modules)


def _wrap_lora(model: nn.Module, modules: list[str], config) -> PeftModel:
    """PEFT's LoRA layers around ``modules`` (``lora_alpha = r``; ``A`` drawn from ``config.seed``)."""
    from peft import LoraConfig, get_peft_model

    pattern = "^(" + "|".join(re.escape(n) for n in modules) + ")$"
    rank = config.tuning.resolved_lora_rank
    lora = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=pattern)
    with warnings.catch_warnings():
        # transformers 5 deprecates the attribute PEFT reads; the message is for PEFT, not for our users
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        with torch.random.fork_rng(devices=[]):  # A's initialisation: drawn from the config's seed, not global state
            torch.manual_seed(config.seed)
            try:
                return get_peft_model(model, lora)
            except (ValueError, NotImplementedError) as err:
                raise ValueError(f"tuning='lora' cannot wrap {modules[:3]}: {err}") from err


@contextlib.contextmanager
def source_values(model: nn.Module, params: Mapping[str, nn.Parameter], source: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Inside, ``model`` computes with the ``source`` values of the in-place adapted ``params`` (names in ``model``):
    each is swapped for a frozen parameter over its source tensor and put back on exit. The adapted parameters
    themselves are not written to, so an autograd graph that saved them (a source view taken between a forward and
    its backward) stays valid."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    try:
        for name, p in params.items():
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner)
            if module._parameters.get(attr) is not p:  # nested use: already swapped
                continue
            value = source[name].to(p.device, p.dtype)  # a no-op unless the model moved since the source was captured
            module._parameters[attr] = nn.Parameter(value, requires_grad=False)
            swapped.append((module, attr, p))
        yield
    finally:
        for module, attr, p in reversed(swapped):
            module._parameters[attr] = p


def param_groups(params: dict[str, nn.Parameter], lr: float, multipliers: dict[str, float]) -> list[dict]:
    """Optimiser parameter groups: one per learning rate, ``lr`` times the first matching multiplier (1 otherwise),
    in the order of ``params``. A pattern that matches no adapted tensor is refused (it would be a silent typo)."""
    compiled = [(re.compile(p), float(f)) for p, f in multipliers.items()]
    unused = [p.pattern for p, _ in compiled if not any(p.search(n) for n in params)]
    if unused:
        raise ValueError(f"lr_multipliers {unused} match no adapted parameter; names look like {next(iter(params))!r}.")
    groups: dict[float, list[nn.Parameter]] = {}
    for name, p in params.items():
        factor = next((f for pat, f in compiled if pat.search(name)), 1.0)
        groups.setdefault(factor, []).append(p)
    return [{"params": ps, "lr": lr * f} for f, ps in groups.items()]


class Anchor:
    """L2-SP's pull towards the source weights (module docstring): ``value()`` is ``(alpha / 2) * sum ||theta -
    theta^0||^2``, with each LoRA layer's effective ``ΔW`` in place of its ``A`` and ``B``."""

    name = "anchor"

    def __init__(self, weight: float, model: nn.Module, params: dict[str, nn.Parameter], source: dict[str, torch.Tensor]):
        self.weight = weight
        self.lora = peft_layers(model, "LoraLayer")
        lora_ids = {id(p) for m in self.lora for p in m.parameters() if p.requires_grad}
        self.plain = [(p, source[n]) for n, p in params.items() if id(p) not in lora_ids]

    def value(self, inputs: ObjectiveInputs | None = None) -> torch.Tensor:
        terms = [(p - p0).pow(2).sum() for p, p0 in self.plain]
        terms += [m.get_delta_weight(a).pow(2).sum() for m in self.lora for a in m.active_adapters if a in m.lora_A]
        return 0.5 * self.weight * torch.stack(terms).sum()


class SourceConsistency:
    """The pull towards the source model's top-k predictions (module docstring): ``value(inputs)`` is
    ``weight * mean_i sum_j p^0_ij (log p^0_ij - log p_ij)`` over the columns ``j`` of query ``i``'s ``top_k`` highest
    source scores, ``p = softmax(scores[i, top-k] / temperature)`` (the adapted scores carry the gradient)."""

    name = "consistency"

    def __init__(self, weight: float, top_k: int, temperature: float):
        self.weight, self.top_k, self.temperature = weight, top_k, temperature

    def value(self, inputs: ObjectiveInputs) -> torch.Tensor:
        source = inputs.source_scores()
        k = min(self.top_k, source.shape[1])
        top = source.topk(k, dim=1).indices
        adapted = inputs.scores.gather(1, top) / self.temperature
        return self.weight * prediction_kl(source.gather(1, top) / self.temperature, adapted)  # REST Eq. 15's KL


def penalties(config, model: nn.Module, params: dict[str, nn.Parameter], source: dict[str, torch.Tensor]) -> list:
    """The loss terms ``config`` (a :class:`~hf_tta.TTAConfig`) adds to every step: the anchor, the consistency."""
    terms: list = []
    anchor, consistency = config.tuning.anchor_weight, config.consistency
    if anchor and params:
        terms.append(Anchor(anchor, model, params, source))
    if consistency is not None and params:
        terms.append(SourceConsistency(consistency.weight, consistency.top_k, consistency.temperature))
    return terms
