"""``hf-tta run``'s adaptation options, generated from :class:`~hf_tta.TTAConfig`'s dataclass fields with
transformers' :class:`~transformers.HfArgumentParser`, so that the command line and the Python API validate through
one path (``TTAConfig.__post_init__``).

The options keep the flat spelling (:mod:`hf_tta.config_flat`): every plain field of TTAConfig and every field of its
nested feature configs is one option (``--weight_decay``, ``--tuning`` for ``TuningConfig.method``, ``--lora_rank``,
``--consistency_weight`` (> 0 turns the consistency term on), ``--gd_per_tensor``, ``--fast_step`` ..., in both
spellings ``--weight_decay`` / ``--weight-decay``, help from the field's metadata), mapped to the nested config in one
place, :func:`hf_tta.config_flat.nest`; an option whose feature is off (``--lora_rank`` without ``--tuning lora``) is
refused in one line. ``--config FILE`` reads a JSON or YAML file of these options or a saved ``tta_config.json``
(nested, or flat from hf_tta 0.1); options on the command line win over the file. The grid decides four fields per run, so their options take part in choosing the grid:

- ``--objective NAME``: the one row besides the source model (``--objectives`` names several);
- ``--query_modality`` / ``--gallery_modality``: must agree with ``--direction``, which sets them per run;
- ``--objective_config`` (= the grid's ``--objective-config``): the objective's overrides, or a JSON object mapping
  rows to overrides;
- ``--gradient_decoupling`` (= the grid's ``--gradient-decoupling``): ``true``, ``false``, or a comma list of
  objectives.

The other fields (``weight_decay``, ``reset_policy``, ``target_modules``, ``autocast_dtype``, ``safety``, ...) are the
base of every row's config: a ``+safe`` row adds the safety layer, ``+dn`` the DN score transform, ``oracle_all`` its
own target modules.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import os
import typing
from pathlib import Path
from typing import Any

from .common import UsageError

logger = logging.getLogger(__name__)

#: Fields whose options the grid's own options serve (they take both spellings; see the module docstring).
GRID_FIELDS = ("objective_config", "gradient_decoupling")
#: Fields the grid sets per run unless given (then they must agree with the grid).
PER_RUN_FIELDS = ("objective", "query_modality", "gallery_modality")
#: What a field means on top of its TTAConfig help in ``hf-tta run``.
CLI_NOTES = {
    "objective": "hf-tta run: the one row besides the source model (--objectives names several). ",
    "seed": "hf-tta run: also seeds the stream order and the corruptions (emoji: the --limit slice). ",
    "safety": "hf-tta run: on every row, e.g. --safety '{}'; '+safe' rows add it to one row. ",
    "target_modules": "hf-tta run: a regex (PEFT semantics), e.g. '.*layer_norm1'; oracle_all rows set their own. ",
    "exclude_modules": "hf-tta run: a regex, e.g. 'qformer.*'. ",
}
#: Fields RunSettings carries itself (the runner sets them on every row's config).
SETTINGS_FIELDS = ("steps", "lr", "seed", "gallery_batch_size")
#: Help of a feature's switch, which has no field of its own in the nested config.
SWITCH_HELP = {
    "consistency_weight": "Consistency with the source model's predictions added to every step's loss: consistency_weight * "
    "mean KL(p_source || p_adapted) over each query's `consistency_top_k` source top items at temperature "
    "`consistency_temperature` (hf_tta.tuning.SourceConsistency; TTAConfig.consistency); 0 = off (the papers' methods).",
}


def flat_fields() -> list[tuple[str, dataclasses.Field, Any, Any]]:
    """Every :class:`~hf_tta.TTAConfig` setting in the command line's flat spelling, in TTAConfig's order:
    ``(flat name, its dataclass field, its type, its default)``; a nested feature's fields under their flat names
    (:data:`hf_tta.config_flat.FLAT_FIELDS`), with the feature's switch where it has one."""
    from ..config import TTAConfig
    from ..config_flat import FLAT_DEFAULTS, FLAT_FIELDS, GROUPS

    flat_of = {where: flat for flat, where in FLAT_FIELDS.items()}
    out = []
    for f in dataclasses.fields(TTAConfig):
        if f.name not in GROUPS:
            out.append((f.name, f, typing.get_type_hints(TTAConfig)[f.name], _default(f)))
            continue
        hints = typing.get_type_hints(GROUPS[f.name])
        if f.name == "gradient_decoupling":
            out.append((f.name, f, bool, FLAT_DEFAULTS[f.name]))
        for nested in dataclasses.fields(GROUPS[f.name]):
            name = flat_of[(f.name, nested.name)]
            kind = int if name == "lora_rank" else hints[nested.name]
            default = FLAT_DEFAULTS[name] if name in FLAT_DEFAULTS else _default(nested)
            out.append((name, nested, kind, default))
    return out


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def _json_object(value: str) -> dict:
    """A JSON object given on the command line (dict fields: ``--safety '{}'``, ``--score_transform_config ...``)."""
    try:
        data = json.loads(value)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"{value!r} is not JSON ({err.msg}); write an object like '{{\"key\": 1}}'.") from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError(f"{value!r} is not a JSON object; write one like '{{\"key\": 1}}'.")
    return data


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one option per :class:`~hf_tta.TTAConfig` field (except :data:`GRID_FIELDS`) to ``parser`` in an
    ``adaptation`` group, through ``HfArgumentParser``'s own field parser. Options default to ``argparse.SUPPRESS`` and the
    parser fills the dataclass defaults in after parsing, with ``namespace.config_given`` naming the options given,
    so that :func:`apply_config` lets ``--config`` fill exactly the others."""
    from transformers import HfArgumentParser

    group = parser.add_argument_group("adaptation (hf_tta.TTAConfig fields; the Python API validates the same way)")
    group.add_argument("--config", default=None, metavar="FILE",
                       help="JSON or YAML file of TTAConfig fields (e.g. a saved tta_config.json); options given here win.")
    late = {}
    for name, f, kind, default in flat_fields():
        if name in GRID_FIELDS:
            continue
        field = copy.copy(f)  # HfArgumentParser rewrites field.type: never touch TTAConfig's own fields
        field.name, field.type, field.default, field.default_factory = name, kind, default, dataclasses.MISSING
        field.metadata = {"help": SWITCH_HELP.get(name, f.metadata.get("help", ""))}  # argparse reads every key
        kinds = (field.type, *typing.get_args(field.type))
        if dict in map(typing.get_origin, kinds) or any(dataclasses.is_dataclass(k) for k in kinds):
            field.type = _json_object  # a dict field, or a feature given whole (--lr_search '{"proxy": "agreement"}')
        if name in PER_RUN_FIELDS:
            field.default = None
        start = len(group._group_actions)
        HfArgumentParser._parse_dataclass_field(group, field)
        late[name] = None if name in PER_RUN_FIELDS else default
        for action in group._group_actions[start:]:
            action.default = argparse.SUPPRESS
            shown = "set per run by the grid" if name in PER_RUN_FIELDS else f"default: {default!r}"
            action.help = f"{action.help or ''} {CLI_NOTES.get(name, '')}({shown})".replace("%", "%%")
    parser.late_defaults = late  # the namespace gets every field; `config_given` says which were on the command line


def _read_file(path: str) -> dict[str, Any]:
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tta_config.json"
    if not p.is_file():
        raise UsageError(f"--config {path}: no such file; pass a JSON or YAML file of TTAConfig fields (or a saved tta_config.json).")
    text = p.read_text()
    try:
        if p.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as err:  # yaml.YAMLError, json.JSONDecodeError
        raise UsageError(f"--config {path}: not valid {'YAML' if p.suffix.lower() in ('.yaml', '.yml') else 'JSON'} "
                         f"({str(err).splitlines()[0]}).") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: holds no mapping of TTAConfig fields.")
    return _flat_file_fields(data, path)


def _flat_file_fields(data: dict[str, Any], path: str) -> dict[str, Any]:
    """A config file's fields in the flat spelling: a file of options as it is; a saved ``tta_config.json`` (nested,
    a checkpoint's with the config as given, or flat from hf_tta 0.1) read by ``TTAConfig.from_dict`` and flattened."""
    from ..config_flat import GROUPS, flatten
    from ..configuration_utils import unknown_key_message

    if "hf_tta_version" in data or any(isinstance(data.get(g), dict) for g in GROUPS):
        try:
            return flatten(_config_class().from_dict(data).to_dict())
        except (TypeError, ValueError) as err:
            raise UsageError(f"--config {path}: {str(err).splitlines()[0]}") from None
    message = unknown_key_message(data, [name for name, *_ in flat_fields()], "hf-tta run")
    if message:
        raise UsageError(f"--config {path}: {message.replace('no field', 'no option')}")
    return data


def _config_class():
    from ..config import TTAConfig

    return TTAConfig



def config_fields(args) -> tuple[dict[str, Any], dict[str, Any]]:
    """The TTAConfig fields the user set: ``--config``'s and the command line's (which win), apart."""
    from_file = _read_file(args.config) if getattr(args, "config", None) else {}
    names = getattr(args, "config_given", None)
    if names is None:  # a namespace built by hand: every field it holds counts as given
        names = [name for name, *_ in flat_fields() if name not in GRID_FIELDS and hasattr(args, name)]
    given = {name: getattr(args, name) for name in names}
    return from_file, given


def apply_config(args, directions: list[str]) -> dict[str, Any]:
    """Resolve the adaptation options of ``args`` (``--config`` + the command line) into the base of every row's
    :class:`~hf_tta.TTAConfig`, validated by ``TTAConfig`` itself; set ``args.<field>`` for every field (so that
    ``args.seed``, ``args.steps`` ... hold the resolved values). Returns the overrides for ``RunSettings``."""
    from ..benchmarks.grid import GALLERY_MODALITY, QUERY_MODALITY
    from ..config_flat import FLAT_FIELDS, nest

    TTAConfig = _config_class()
    from_file, given = config_fields(args)
    fields = {**from_file, **given}
    for name, per_dir in (("query_modality", QUERY_MODALITY), ("gallery_modality", GALLERY_MODALITY)):
        wanted = fields.pop(name, None)
        clash = [d for d in directions if wanted is not None and per_dir[d] != wanted]
        if clash:
            raise UsageError(f"--{name} {wanted} disagrees with --direction {','.join(clash)}, which sets it per run; "
                             "leave it out or choose the direction.")
    objective = fields.pop("objective", None)
    if objective is not None:
        if getattr(args, "objectives", None) is None:
            args.objectives = objective
        elif "objective" in given:
            raise UsageError("give --objective (one row) or --objectives (several), not both.")
        else:
            logger.info("--objectives %s replaces the objective %r of --config.", args.objectives, objective)
    # The two fields the grid's options serve: the file's value applies unless the option is given.
    for name, option in (("objective_config", "objective_config"), ("gradient_decoupling", "gradient_decoupling")):
        value = fields.pop(name, None)
        if value not in (None, {}, False) and getattr(args, option, None) is None:
            setattr(args, option, json.dumps(value) if isinstance(value, dict) else str(value).lower())
    # The grid turns gradient decoupling on per row: its options are checked as if on, unless it is off everywhere.
    gd_options = [k for k in fields if FLAT_FIELDS.get(k, ("",))[0] == "gradient_decoupling"]
    if gd_options and str(getattr(args, "gradient_decoupling", None)).lower() == "false":
        raise UsageError(f"--{gd_options[0]} applies only with gradient decoupling on: drop --gradient_decoupling false or --{gd_options[0]}.")
    # One validation path: the flat options nested by hf_tta.config_flat.nest, then the dataclasses' own checks (each
    # row's full config is checked again in prepare_run).
    for d in directions:
        try:
            TTAConfig(**nest({**fields, "objective": "tent", "query_modality": QUERY_MODALITY[d],
                              "gallery_modality": GALLERY_MODALITY[d], "gradient_decoupling": bool(gd_options)}))
        except (TypeError, ValueError) as err:
            raise UsageError(f"{str(err).splitlines()[0]} (an adaptation option; see `hf-tta run --help`)") from None
    for name, _, _, default in flat_fields():
        if name not in GRID_FIELDS + PER_RUN_FIELDS:
            setattr(args, name, fields.get(name, default))
    if fields:
        logger.info("Adaptation options: %s", fields)
    return {k: v for k, v in fields.items() if k not in SETTINGS_FIELDS}


def autocast_from_accelerate(args) -> None:
    """Honour ``accelerate launch --mixed_precision`` (``ACCELERATE_MIXED_PRECISION``) in a recipe: ``bf16`` sets
    ``args.autocast_dtype = "bf16"`` (TTAConfig's autocast of the query forward), ``no`` changes nothing, ``fp16``
    and ``fp8`` are refused in one line that names bf16."""
    mode = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if mode in ("", "no"):
        return
    if mode != "bf16":
        raise UsageError(f"accelerate --mixed_precision {mode}: hf_tta adapts in fp32 or under bf16 autocast only "
                         "(fp16 gradients of the adapted norms need a gradient scaler); launch with --mixed_precision bf16 or no.")
    current = getattr(args, "autocast_dtype", None)
    if current not in (None, "bf16"):
        raise UsageError(f"accelerate --mixed_precision bf16 disagrees with --autocast_dtype {current}; give one of them.")
    if current is None:
        logger.info("accelerate --mixed_precision bf16: adapting under bf16 autocast (TTAConfig.autocast_dtype='bf16').")
    args.autocast_dtype = "bf16"
    if getattr(args, "config_given", None) is not None and "autocast_dtype" not in args.config_given:
        args.config_given = sorted([*args.config_given, "autocast_dtype"])  # as if given: apply_config keeps it
