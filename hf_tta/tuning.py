"""What a wrapper adapts and how fast: the PEFT wrapping of the query tower, per-group learning rates, and the pull
towards the source weights.

``TTAConfig.tuning`` (a :class:`~hf_tta.TuningConfig`) picks with its ``method`` how the selected modules
(``target_modules``, default: the query tower's normalisation layers) adapt:

* ``"ln"`` (default, every seed's methods): every parameter of the selected modules, through PEFT's LN tuning (a
  trainable copy of each module; ``disable_adapter()`` computes with the frozen originals).
* ``"bias"``: only their biases (BitFit, Ben Zaken et al. 2022); without ``target_modules``, every module of the query
  tower that has a bias.
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
``model_cards/emoji-benchmark-results.md``, issue 29's round 3), so it is off by default and in no preset.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass

import torch
from peft import LNTuningConfig, LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from .gradient_decoupling import prediction_kl
from .models.base import ModelAdapter, resolve_target_modules
from .models.checkpointing import enable_gradient_checkpointing
from .objectives.base import ObjectiveInputs

logger = logging.getLogger(__name__)

@dataclass
class Targets:
    """The wrapped model's PEFT handle, the adapted tensors by name and the modules they live in."""

    peft_model: PeftModel
    params: dict[str, nn.Parameter]
    modules: list[str]


def bias_modules(adapter: ModelAdapter, modality: str) -> list[str]:
    """Every module of ``modality``'s tower that owns a ``bias`` parameter (BitFit's default selection)."""
    return [
        name for name, module in adapter.model.named_modules()
        if name and isinstance(getattr(module, "bias", None), nn.Parameter) and modality in adapter.tower_of(name)
    ]


def wrap_targets(adapter: ModelAdapter, modality: str, config) -> Targets:
    """Wrap ``adapter.model`` with PEFT so that exactly what ``config`` (a :class:`~hf_tta.TTAConfig`) selects is
    trainable; the model is left in eval mode."""
    model = adapter.model
    if any(isinstance(m, BaseTunerLayer) for m in model.modules()):
        raise ValueError(
            "This model already carries PEFT adapter layers (does another TTAWrapper wrap it?): pass a fresh "
            "source model, or load a checkpoint into the existing wrapper with its load_state(path)."
        )
    tuned = config.tuning  # a TuningConfig
    target = tuned.target_modules
    if tuned.method == "lora" and target is None:
        raise ValueError("tuning='lora' needs target_modules naming the Linear/Conv layers to adapt, e.g. "
                         "target_modules='.*vision_model.*pwconv[12]'.")
    if tuned.method == "bias" and target is None:
        target = bias_modules(adapter, modality)
    modules = resolve_target_modules(adapter, modality, target, tuned.exclude_modules)
    pattern = "^(" + "|".join(re.escape(n) for n in modules) + ")$"
    with warnings.catch_warnings():  # PEFT warns "Unsupported layer type LayerNorm": LN tuning is what we want
        warnings.filterwarnings("ignore", message="Unsupported layer type")
        # transformers 5 deprecates the attribute PEFT reads; the message is for PEFT, not for our users
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        if tuned.method == "lora":
            rank = tuned.resolved_lora_rank
            lora = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=pattern)
            with torch.random.fork_rng(devices=[]):  # A's initialisation: drawn from the config's seed, not global state
                torch.manual_seed(config.seed)
                try:
                    peft_model = get_peft_model(model, lora)
                except (ValueError, NotImplementedError) as err:
                    raise ValueError(f"tuning='lora' cannot wrap {modules[:3]}: {err}") from err
        else:
            peft_model = get_peft_model(model, LNTuningConfig(target_modules=pattern))
    if tuned.method == "bias":
        for name, p in model.named_parameters():
            if p.requires_grad and not name.endswith(".bias"):
                p.requires_grad_(False)
    model.eval()
    if config.run.gradient_checkpointing:  # after every eval(): it marks the tower's layers as training
        enable_gradient_checkpointing(adapter, modality)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise ValueError(f"tuning={tuned.method!r} leaves nothing to adapt in {modules[:3]}: select other target_modules.")
    return Targets(peft_model, params, modules)


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
        self.lora = [m for m in model.modules() if isinstance(m, LoraLayer)]
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
