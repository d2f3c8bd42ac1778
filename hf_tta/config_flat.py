"""The flat spelling of :class:`~hf_tta.TTAConfig`: one name per setting, as ``hf-tta run``'s options spell them
(``--tuning lora --lora_rank 8 --consistency_weight 1``) and as ``TTAConfig`` spelled its fields before its optional
features nested (``tta_config.json`` files written by hf_tta 0.1).

:func:`nest` is the one conversion from the flat spelling to the nested fields. The command line goes through it for
every run; a flat ``tta_config.json`` and flat keyword arguments (``TTAConfig(lora_rank=8, tuning="lora")``) go
through it too, with a one-line ``FutureWarning`` naming the nested spelling. A flat field whose feature is off is
refused, naming the switch (``consistency_top_k`` without ``consistency_weight``); only in a deprecated flat config, which
wrote every field out, are such fields dropped when they hold their old default (they never had an effect).
:func:`flatten` is the inverse, for a nested config file given to ``hf-tta run --config``.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

from .config_features import (
    DEFAULT_LORA_RANK,
    ConsistencyConfig,
    GradientDecouplingConfig,
    RunConfig,
    TuningConfig,
)
from .configuration_utils import ConfigMixin

#: Each flat name and the nested field it spells: ``(TTAConfig field, field of its config)``.
FLAT_FIELDS: dict[str, tuple[str, str]] = {
    "tuning": ("tuning", "method"),
    "target_modules": ("tuning", "target_modules"),
    "exclude_modules": ("tuning", "exclude_modules"),
    "lora_rank": ("tuning", "lora_rank"),
    "lr_multipliers": ("tuning", "lr_multipliers"),
    "anchor_weight": ("tuning", "anchor_weight"),
    "consistency_weight": ("consistency", "weight"),
    "consistency_top_k": ("consistency", "top_k"),
    "consistency_temperature": ("consistency", "temperature"),
    "gd_weight_on": ("gradient_decoupling", "weight_on"),
    "gd_per_tensor": ("gradient_decoupling", "per_tensor"),
    "gallery_batch_size": ("run", "gallery_batch_size"),
    "fast_step": ("run", "fast_step"),
    "scoring": ("run", "scoring"),
    "gradient_checkpointing": ("run", "gradient_checkpointing"),
}
#: The config class of each nested field the flat names spell.
GROUPS: dict[str, type[ConfigMixin]] = {
    "tuning": TuningConfig, "consistency": ConsistencyConfig, "gradient_decoupling": GradientDecouplingConfig, "run": RunConfig,
}
#: Flat defaults where the nested field has none or another: the switches (off) and the LoRA rank in use.
FLAT_DEFAULTS: dict[str, Any] = {"consistency_weight": 0.0, "gradient_decoupling": False, "lora_rank": DEFAULT_LORA_RANK}
#: How a flat user turns each optional feature on (named when one of its fields is given while it is off).
_SWITCH_HINT = {"consistency": "set consistency_weight > 0", "gradient_decoupling": "set gradient_decoupling=True"}


def flat_keys(data: Mapping[str, Any]) -> list[str]:
    """The keys of ``data`` in the flat spelling (``tuning`` only as a method name; ``gradient_decoupling=True`` is
    also the nested shorthand for ``GradientDecouplingConfig()``)."""
    return [k for k in data if k in FLAT_FIELDS and not (k == "tuning" and not isinstance(data[k], str))]


def nest(data: Mapping[str, Any], *, deprecated: str | None = None) -> dict[str, Any]:
    """``data`` (TTAConfig fields, some spelled flat) with its flat fields nested: the keyword arguments of
    ``TTAConfig``. ``deprecated`` names where a deprecated flat spelling came from (a warning says so, once per call
    site); the command line's flat options pass ``None``."""
    flat = flat_keys(data)
    out = {k: v for k, v in data.items() if k not in flat}
    if not flat:
        return out
    if deprecated:
        warnings.warn(
            f"{deprecated} spells TTAConfig's fields flat ({', '.join(flat[:3])}{', ...' if len(flat) > 3 else ''}), "
            "which is deprecated: nest them (TTAConfig(tuning=TuningConfig(...), consistency=ConsistencyConfig(...), "
            "gradient_decoupling=GradientDecouplingConfig(...), run=RunConfig(...))) or re-save the config.",
            FutureWarning, stacklevel=3,
        )
    given: dict[str, dict[str, Any]] = {}
    for key in flat:
        group, name = FLAT_FIELDS[key]
        given.setdefault(group, {})[name] = data[key]
    for group, values in given.items():
        switch = out.get(group)
        if group == "gradient_decoupling" and switch is True:
            switch = None
        elif switch is not None and switch is not False:
            names = ", ".join(_flat_name(group, n) for n in values)
            raise ValueError(f"`{group}` is given nested and as the flat fields {names}: give one of them.")
        if group == "consistency":
            weight = values.pop("weight", 0.0)
            on = weight is None or weight != 0  # None and garbage reach ConsistencyConfig, which names them
            values = {"weight": weight, **values} if on else values
        elif group == "gradient_decoupling":
            on = out.get(group) is True
        else:
            on = True
        if group == "tuning" and deprecated and values.get("method", "ln") != "lora" and values.get("lora_rank") == DEFAULT_LORA_RANK:
            values.pop("lora_rank")  # every flat config wrote the old default out
        if not on:
            if deprecated:
                defaults = GROUPS[group].__dataclass_fields__
                values = {n: v for n, v in values.items() if v != defaults[n].default}
            if values:
                name = _flat_name(group, next(iter(values)))
                raise ValueError(f"`{name}` applies only with {group.replace('_', ' ')} on: {_SWITCH_HINT[group]} or drop it.")
            out[group] = None
            continue
        out[group] = _build(group, values)
    return out


def flatten(data: Mapping[str, Any]) -> dict[str, Any]:
    """A nested config's fields (``TTAConfig.to_dict()``, e.g. a saved ``tta_config.json``) in the flat spelling: a
    feature that is off gives its switch only, a LoRA rank left out is left out."""
    out = {k: v for k, v in data.items() if k not in GROUPS or (k == "tuning" and isinstance(v, str))}
    for group in GROUPS:
        value = data.get(group)
        if group not in data or (group == "tuning" and isinstance(value, str)):
            continue
        if isinstance(value, bool) or value is None:
            if group == "gradient_decoupling":
                out[group] = bool(value)
            elif group == "consistency":
                out["consistency_weight"] = 0.0
            continue
        fields = value.to_dict() if isinstance(value, ConfigMixin) else dict(value)
        if group == "gradient_decoupling":
            out[group] = True
        for name, v in fields.items():
            if not (name == "lora_rank" and v is None):
                out[_flat_name(group, name)] = v
    return out


def _flat_name(group: str, name: str) -> str:
    return next((flat for flat, where in FLAT_FIELDS.items() if where == (group, name)), name)


def _build(group: str, values: dict[str, Any]) -> ConfigMixin:
    """``GROUPS[group](**values)``; a refusal names the flat fields (``consistency_top_k``, not ``top_k``)."""
    cls = GROUPS[group]
    try:
        return cls(**values)
    except (TypeError, ValueError) as err:
        message = str(err)
        for name in cls.__dataclass_fields__:
            flat = _flat_name(group, name)
            message = message.replace(f"{cls.__name__} `{name}", f"`{flat}").replace(f"`{name}`", f"`{flat}`")
            message = message.replace(f"{name}=", f"{flat}=")
        raise type(err)(message) from None
