"""``hf-tta run``'s adaptation options, generated from :class:`~hf_tta.TTAConfig`'s dataclass fields with
transformers' :class:`~transformers.HfArgumentParser`, so that the command line and the Python API validate through
one path (``TTAConfig.__post_init__``).

Every field is an option (``--weight_decay`` and ``--weight-decay`` alike, help from the field's metadata), and
``--config FILE`` reads a JSON or YAML file of fields (e.g. the ``tta_config.json`` a wrapper saved); options on the
command line win over the file. The grid decides four fields per run, so their options take part in choosing the grid:

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

    from ..config import TTAConfig

    group = parser.add_argument_group("adaptation (hf_tta.TTAConfig fields; the Python API validates the same way)")
    group.add_argument("--config", default=None, metavar="FILE",
                       help="JSON or YAML file of TTAConfig fields (e.g. a saved tta_config.json); options given here win.")
    hints = typing.get_type_hints(TTAConfig)
    late = {}
    for f in dataclasses.fields(TTAConfig):
        if f.name in GRID_FIELDS or not f.init:
            continue
        field = copy.copy(f)  # HfArgumentParser rewrites field.type: never touch TTAConfig's own fields
        field.type = hints[f.name]
        if dict in (typing.get_origin(field.type), *map(typing.get_origin, typing.get_args(field.type))):
            field.type = _json_object
        if f.name in PER_RUN_FIELDS:
            field.default = None
        start = len(group._group_actions)
        HfArgumentParser._parse_dataclass_field(group, field)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        late[f.name] = None if f.name in PER_RUN_FIELDS else default
        for action in group._group_actions[start:]:
            action.default = argparse.SUPPRESS
            shown = "set per run by the grid" if f.name in PER_RUN_FIELDS else f"default: {default!r}"
            action.help = f"{action.help or ''} {CLI_NOTES.get(f.name, '')}({shown})".replace("%", "%%")
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
    data.pop("hf_tta_version", None)  # written by TTAConfig.save_pretrained
    known = {f.name for f in dataclasses.fields(_config_class())}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UsageError(f"--config {path}: {unknown} are not TTAConfig fields; valid: {', '.join(sorted(known))}.")
    return data


def _config_class():
    from ..config import TTAConfig

    return TTAConfig


def config_fields(args) -> tuple[dict[str, Any], dict[str, Any]]:
    """The TTAConfig fields the user set: ``--config``'s and the command line's (which win), apart."""
    from_file = _read_file(args.config) if getattr(args, "config", None) else {}
    names = getattr(args, "config_given", None)
    if names is None:  # a namespace built by hand: every field it holds counts as given
        names = [f.name for f in dataclasses.fields(_config_class()) if f.name not in GRID_FIELDS and hasattr(args, f.name)]
    given = {name: getattr(args, name) for name in names}
    return from_file, given


def apply_config(args, directions: list[str]) -> dict[str, Any]:
    """Resolve the adaptation options of ``args`` (``--config`` + the command line) into the base of every row's
    :class:`~hf_tta.TTAConfig`, validated by ``TTAConfig`` itself; set ``args.<field>`` for every field (so that
    ``args.seed``, ``args.steps`` ... hold the resolved values). Returns the overrides for ``RunSettings``."""
    from ..benchmarks.grid import GALLERY_MODALITY, QUERY_MODALITY

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
    # One validation path: the dataclass's own checks (each row's full config is checked again in prepare_run).
    for d in directions:
        try:
            TTAConfig(**{**fields, "objective": "tent", "query_modality": QUERY_MODALITY[d], "gallery_modality": GALLERY_MODALITY[d]})
        except (TypeError, ValueError) as err:
            raise UsageError(f"{str(err).splitlines()[0]} (an adaptation option; see `hf-tta run --help`)") from None
    defaults = TTAConfig(objective="tent")
    for f in dataclasses.fields(TTAConfig):
        if f.name not in GRID_FIELDS + PER_RUN_FIELDS:
            setattr(args, f.name, fields.get(f.name, getattr(defaults, f.name)))
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
