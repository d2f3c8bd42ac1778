"""The settings of the learning-rate search (:mod:`hf_tta.lr_search`, issue 37): :class:`LRSearchConfig` and the
choice rule :func:`choose`, which the probe's commit and (``serve="leader"``) its leader apply to the proxies' means."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .configuration_utils import ConfigMixin, check_choice, check_field_types

ONLINE_RULES = ("hypergradient",)
#: beta of the multiplicative rule, set a priori (before any measurement): at most a 2 % change of the lr per step.
DEFAULT_HYPERGRADIENT_RATE = 0.02


def check_online(online: str | None, rate: float | None) -> None:
    """Refuse a bad ``LRSearchConfig.online`` / ``hypergradient_rate`` in one line naming the fix."""
    if online is not None and online not in ONLINE_RULES:
        raise ValueError(f"LRSearchConfig `online` must be None or one of {list(ONLINE_RULES)}, got {online!r}.")
    if rate is None:
        return
    if online != "hypergradient":
        raise ValueError(f"LRSearchConfig `hypergradient_rate` applies to online='hypergradient' only (here online="
                         f"{online!r}): drop it or set online='hypergradient'.")
    if isinstance(rate, bool) or not 0 < rate < 1:
        raise ValueError(f"LRSearchConfig `hypergradient_rate` must be in (0, 1), got {rate!r}.")


PROXIES = ("next_loss", "agreement", "uniformity", "gap")
#: The default candidates, relative to the base lr: a half-decade grid (1-3-10 steps) from a third of it to 33 times it,
#: e.g. (1e-4, 3e-4, 1e-3, 3e-3, 1e-2) around the image towers' 3e-4 (TCR's lr), (1e-5, ..., 1e-3) around BLIP text's
#: 3e-5. Issue 37: 10x the paper's lr wins most on the emoji image tower, and does nothing on the MiniLM text tower.
DEFAULT_FACTORS = (1 / 3, 1.0, 10 / 3, 10.0, 100 / 3)
DEFAULT_AGREEMENT_FLOOR = 0.5
_LOWER_IS_BETTER = {"next_loss": True, "uniformity": False, "gap": True}
#: who answers a probe batch: the source model (selector (a)), or the leading shadow (selector (b))
SERVES = ("source", "leader")


@dataclass
class LRSearchConfig(ConfigMixin):
    """The learning-rate search (see :mod:`hf_tta.lr_search`). Present = on.

    Example:
        >>> LRSearchConfig().resolved_candidates(3e-4)
        [0.0001, 0.0003, 0.001, 0.003, 0.01]
        >>> LRSearchConfig(agreement_floor=0.8)
        Traceback (most recent call last):
        ...
        ValueError: LRSearchConfig `agreement_floor` applies to proxy='agreement' only (here proxy='next_loss'): drop it or set proxy='agreement'.
    """

    candidates: list[float] | None = field(
        default=None,
        metadata={"help": "The candidate lrs, increasing; None = a half-decade grid around the base lr (TTAConfig.lr or "
                          "the model's default): x (1/3, 1, 10/3, 10, 100/3), e.g. 1e-4 ... 1e-2 around 3e-4."},
    )
    probe_batches: int = field(
        default=4,
        metadata={"help": "Stream batches the probe lasts (>= 2: the first only starts the shadows); 0 (with backoff or "
                          "online) = no probe: start at the highest candidate and back off (selector (d) alone), or at "
                          "the candidate nearest the base lr with online (selector (c) alone)."},
    )
    proxy: str = field(
        default="next_loss",
        metadata={"help": "The label-free signal that chooses: 'next_loss', 'agreement', 'uniformity' or 'gap'."},
    )
    agreement_floor: float | None = field(
        default=None,
        metadata={"help": f"With proxy='agreement': the highest lr whose source top-1 agreement stays at or above "
                          f"this floor in (0, 1] wins (default {DEFAULT_AGREEMENT_FLOOR})."},
    )
    backoff: float | None = field(
        default=None,
        metadata={"help": "Multiply the lr in use by this factor in (0, 1) after each safety rollback (a collapse of "
                          "source agreement) or reset, never below the lowest candidate (needs TTAConfig.safety); "
                          "None = off."},
    )
    online: str | None = field(
        default=None,
        metadata={"help": "'hypergradient' = move the lr at every served step by the multiplicative hypergradient rule "
                          "(Baydin et al. 2018, hf_tta.lr_online) within the candidates' range, at no extra pass."},
    )
    hypergradient_rate: float | None = field(
        default=None,
        metadata={"help": f"online='hypergradient''s beta in (0, 1) (default {DEFAULT_HYPERGRADIENT_RATE})."},
    )
    serve: str = field(
        default="source",
        metadata={"help": "Who answers a probe batch: 'source' (the source model) or 'leader' (selector (b): the "
                          "shadow whose mean proxy over the earlier probe batches is best, by the commit's rule, with "
                          "its forward before adapting on the batch, at no extra pass; the source until a score exists)."},
    )

    def __post_init__(self):
        if isinstance(self.candidates, tuple):
            self.candidates = list(self.candidates)
        check_field_types(self)
        if self.candidates is not None:
            c = self.candidates
            ok = len(c) >= 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf for v in c)
            if not ok or any(b <= a for a, b in zip(c, c[1:])):
                raise ValueError(f"LRSearchConfig `candidates` must be at least 2 finite lrs > 0 in increasing order, got {c!r}.")
        check_online(self.online, self.hypergradient_rate)
        unprobed = self.probe_batches == 0 and (self.backoff or self.online)
        if isinstance(self.probe_batches, bool) or self.probe_batches < 2 and not unprobed:
            raise ValueError(f"LRSearchConfig `probe_batches` must be an integer >= 2 (the first probe batch only "
                             f"starts the shadows), or 0 with `backoff` or `online` (no probe), got {self.probe_batches!r}.")
        check_choice("proxy", self.proxy, PROXIES, owner="LRSearchConfig")
        check_choice("serve", self.serve, SERVES, owner="LRSearchConfig")
        if self.serve != "source" and self.probe_batches == 0:
            raise ValueError(f"LRSearchConfig `serve` applies to the probe only (here probe_batches=0): drop it or set "
                             f"probe_batches >= 2, got serve={self.serve!r}.")
        if self.agreement_floor is not None:
            if self.proxy != "agreement":
                raise ValueError(f"LRSearchConfig `agreement_floor` applies to proxy='agreement' only (here proxy="
                                 f"{self.proxy!r}): drop it or set proxy='agreement'.")
            if not 0 < self.agreement_floor <= 1:
                raise ValueError(f"LRSearchConfig `agreement_floor` must be in (0, 1], got {self.agreement_floor!r}.")
        if self.backoff is not None and not 0 < self.backoff < 1:
            raise ValueError(f"LRSearchConfig `backoff` must be in (0, 1) or None, got {self.backoff!r}.")

    rate = property(lambda self: DEFAULT_HYPERGRADIENT_RATE if self.hypergradient_rate is None else self.hypergradient_rate)

    @property
    def floor(self) -> float:
        """The agreement floor in use."""
        return self.agreement_floor if self.agreement_floor is not None else DEFAULT_AGREEMENT_FLOOR

    def resolved_candidates(self, base_lr: float) -> list[float]:
        """The candidate lrs around ``base_lr`` (3 significant digits for the default grid)."""
        if self.candidates is not None:
            return [float(c) for c in self.candidates]
        return [float(f"{base_lr * f:.3g}") for f in DEFAULT_FACTORS]


# ------------------------------------------------------------------------------------------------- the choice rule
def choose(proxy: str, lrs: list[float], values: list[float], valid: list[bool], base_lr: float,
           floor: float = DEFAULT_AGREEMENT_FLOOR) -> int:
    """The index of the chosen lr given each candidate's mean proxy ``values`` and whether it stayed ``valid``
    (finite on every scored batch). See :mod:`hf_tta.lr_search` for the rule of each proxy; with no valid candidate,
    the lowest lr."""
    alive = [k for k in range(len(lrs)) if valid[k] and math.isfinite(values[k])]
    if not alive:
        return 0
    if proxy == "agreement":
        above = [k for k in alive if values[k] >= floor]
        if above:
            return max(above, key=lambda k: lrs[k])
        key = [-values[k] for k in range(len(lrs))]  # the most agreeing
    else:
        key = [v if _LOWER_IS_BETTER[proxy] else -v for v in values]
    best = min(key[k] for k in alive)
    tied = [k for k in alive if key[k] == best]
    return min(tied, key=lambda k: (abs(math.log(lrs[k] / base_lr)), lrs[k]))
