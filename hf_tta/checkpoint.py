"""Checkpoint folders that survive a kill, and the fingerprint of the model a checkpoint was adapted from.

A checkpoint is a folder with two files: ``tta_config.json`` (the full resolved :class:`~hf_tta.TTAConfig`, readable)
and ``tta_state.safetensors`` (every tensor of the wrapper's state; its metadata holds the same config, the model
fingerprint and the optimiser's non-tensor state). The state file is self-contained: loading reads the config from
it, so a reader never pairs one save's config with another save's state.

**How a folder ``D`` is written** (:func:`write_checkpoint`), so that a reader sees the old complete checkpoint or the
new complete one, whenever the writing process dies:

1. both files are written into a fresh folder ``.D.tmp-<pid>-<random>`` beside ``D`` (same filesystem), each file
   flushed and ``fsync``-ed, then the folder itself ``fsync``-ed;
2. if ``D`` exists it is renamed to the backup ``.D.old`` (a backup left by an earlier interrupted save is removed
   first, which is safe because ``D`` is then complete);
3. the temporary folder is renamed to ``D``, and the parent folder ``fsync``-ed;
4. the backup is removed.

A kill during 1 leaves ``D`` untouched (the stale temporary folder is removed by the next save); between 2 and 3
there is no ``D`` but a complete ``.D.old``, which :func:`read_checkpoint` loads (with a warning); between 3 and 4,
``D`` is the new checkpoint and the stale backup is removed by the next save. ``D`` may hold only checkpoint files
(a folder with other files is refused rather than moved). One writer per folder at a time.

**What the state file holds** (:meth:`hf_tta.state.AdapterState.to_tensors` and the safety monitor's
``state_tensors`` write it): tensors ``param.*``, ``optim.*``, ``objective.*``, ``score_transform.*``, ``wrapper.*`` and
``safety.*`` (a routed wrapper: each domain's under ``domain.<i>.``, and ``router.*``); metadata ``"optimizer"`` (param
groups and non-tensor state), ``"safety"``, ``"param_names"``, ``"fingerprint"`` (and ``"routed"``), and
``"tensors_sha256"``: the SHA-256 of every tensor's name, dtype, shape and bytes (:func:`tensors_digest`).

**Integrity.** Reading recomputes ``tensors_sha256`` and refuses a file whose tensors do not match it (a flipped bit,
a copy damaged in transit) with :class:`CheckpointError`, one line naming the file; so is every file that is not a
whole safetensors file (empty, truncated, a damaged header, another format). A state file written before the digest
existed loads with a one-line warning that says to re-save it. Nothing is changed before the file is accepted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint's state file cannot be trusted: malformed, or its tensors do not match their digest."""

CONFIG_FILE = "tta_config.json"
STATE_FILE = "tta_state.safetensors"
CHECKPOINT_FILES = (CONFIG_FILE, STATE_FILE)
FORMAT = 1  # bump when the layout of the state file changes
# Config keys that describe how a model was loaded or serialised, not what it computes.
_VOLATILE_KEYS = frozenset({"transformers_version", "architectures", "dtype", "torch_dtype"})


# ---------------------------------------------------------------------------------------------------- fingerprint
def config_hash(model: nn.Module) -> str:
    """SHA-256 of the model's config (``to_diff_dict()`` without load/serialisation keys such as ``dtype``,
    ``architectures``, ``_name_or_path``); for a model without a Hugging Face config, of its parameter names and shapes."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_diff_dict"):
        payload: Any = _drop_volatile(config.to_diff_dict())
    else:
        payload = [(n, list(p.shape)) for n, p in model.named_parameters()]
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _drop_volatile(value: Any) -> Any:
    if isinstance(value, dict):
        # keys as JSON writes them: some transformers versions keep int keys (id2label) in nested configs
        return {
            str(k): _drop_volatile(v) for k, v in value.items() if k not in _VOLATILE_KEYS and not str(k).startswith("_")
        }
    if isinstance(value, (list, tuple)):
        return [_drop_volatile(v) for v in value]
    return value


def model_fingerprint(
    model: nn.Module, params: Mapping[str, torch.Tensor], source: Mapping[str, torch.Tensor] | None = None,
    names: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """What a checkpoint was adapted from: the model's class, its config hash, the adapted parameters' names and shapes,
    and (given ``source``, their values before adaptation) a hash of those source values, which tells two checkpoints
    of one architecture apart. ``names`` (:attr:`Checkpoint.legacy_names`) hashes the source under the names an
    older checkpoint used, to compare with its hash."""
    out: dict[str, Any] = {
        "model_class": type(model).__name__,
        "config_sha256": config_hash(model),
        "adapted": {name: list(p.shape) for name, p in params.items()},
    }
    if source:
        digest = hashlib.sha256()
        names = names or {}
        for name in sorted(source, key=lambda n: names.get(n, n)):  # float32 bytes: the same on every device and dtype
            digest.update(names.get(name, name).encode())
            digest.update(source[name].detach().float().cpu().contiguous().numpy().tobytes())
        out["source_sha256"] = digest.hexdigest()
    return out


def unwrapped_source(model: nn.Module, adapted: Mapping[str, Any]) -> dict[str, torch.Tensor] | None:
    """The values of a checkpoint's adapted parameters in a model no wrapper has touched yet, for
    :func:`model_fingerprint` before the wrapper is built; ``None`` if the model lacks one of them (a LoRA factor)."""
    try:
        return {n: model.get_parameter(n) for n in adapted}
    except AttributeError:
        return None


def describe_fingerprint(fp: Mapping[str, Any]) -> str:
    """``Class (config sha256 <12 hex>, N adapted tensors)``; a model no wrapper adapts yet (or a training-free
    wrapper's) without the count."""
    count = f", {len(fp['adapted'])} adapted tensors" if fp.get("adapted") else ""
    return f"{fp['model_class']} (config sha256 {fp['config_sha256'][:12]}{count})"


def fingerprint_mismatch(saved: Mapping[str, Any], current: Mapping[str, Any], check_params: bool = True) -> str | None:
    """``None`` if ``current`` is the model ``saved`` describes, else a message naming both."""
    if saved["model_class"] != current["model_class"]:
        why = "another model class."
    elif saved["config_sha256"] != current["config_sha256"]:
        why = "another model config."
    elif check_params and saved["adapted"] != current["adapted"]:
        names = sorted(set(saved["adapted"]) ^ set(current["adapted"]))
        shapes = [n for n in saved["adapted"] if n in current["adapted"] and saved["adapted"][n] != current["adapted"][n]]
        detail = f"names differ, e.g. {names[:2]}" if names else f"shapes differ, e.g. {shapes[:2]}"
        why = f"a wrapper that adapts other parameters ({detail}): another query modality or target_modules?"
    elif saved.get("source_sha256") and current.get("source_sha256") and saved["source_sha256"] != current["source_sha256"]:
        why = "other weights (the adapted layers' source values differ): another checkpoint of this architecture?"
    else:
        return None
    return (
        f"This checkpoint was adapted from {describe_fingerprint(saved)}, but it is being loaded into "
        f"{describe_fingerprint(current)}: {why} Load it into the source model it was adapted from."
    )


# ---------------------------------------------------------------------------------------------------- integrity
def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over the tensors in name order: each one's name, dtype, shape and raw bytes (as stored, on CPU), so that
    any changed value, renamed, added or dropped tensor changes it."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------------- write
def write_checkpoint(
    directory: str | os.PathLike, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]
) -> Path:
    """Write ``config`` and ``tensors`` (+ ``metadata``) as a checkpoint folder, atomically (see the module docstring)."""
    target = Path(directory).absolute()
    if target.exists() and not target.is_dir():
        raise ValueError(f"save_directory {str(target)!r} is a file: give a folder path.")
    if target.is_dir():
        foreign = sorted(p.name for p in target.iterdir() if p.name not in CHECKPOINT_FILES)
        if foreign:
            raise ValueError(
                f"save_directory {str(target)!r} holds other files than a checkpoint ({foreign[:3]}): the checkpoint "
                "folder is replaced as a whole, so give it a folder of its own (e.g. a subfolder)."
            )
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    for stale in parent.glob(f".{target.name}.tmp-*"):  # left by a killed save
        shutil.rmtree(stale, ignore_errors=True)
    config_text = json.dumps(dict(config), indent=2, sort_keys=True) + "\n"
    digest = tensors_digest(tensors)
    meta = {"hf_tta": json.dumps({**metadata, "config": dict(config), "format": FORMAT, "tensors_sha256": digest})}
    tmp = parent / f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        _write_synced(tmp / CONFIG_FILE, config_text.encode())
        _write_synced(tmp / STATE_FILE, save_safetensors(dict(tensors), metadata=meta))
        _fsync_dir(tmp)
        backup = _backup(target)
        if target.exists():
            if backup.exists():  # an earlier save died after step 3: target is complete, the backup is stale
                shutil.rmtree(backup)
            os.rename(target, backup)
        os.rename(tmp, target)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(backup, ignore_errors=True)
    return target


def _backup(target: Path) -> Path:
    return target.parent / f".{target.name}.old"


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    if os.name != "posix":  # folders cannot be opened for fsync on Windows; rename is still atomic there
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------- read
@dataclass
class Checkpoint:
    """A checkpoint read from one folder: its config, tensors (on CPU) and metadata."""

    path: Path
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any]
    legacy_names: dict[str, str] = field(default_factory=dict)  # read name -> as written (PEFT LN-tuning names)

    @property
    def fingerprint(self) -> dict[str, Any] | None:
        return self.metadata.get("fingerprint")


def read_checkpoint(directory: str | os.PathLike, attempts: int = 3) -> Checkpoint:
    """Read the checkpoint in ``directory``, or its backup when a save was interrupted between the two renames.

    The state file is read in one ``open`` (its metadata carries the config), so a concurrent save cannot pair two
    saves' halves; a reader that meets the instant between the two renames retries.
    """
    target = Path(directory).absolute()
    for attempt in range(attempts):
        for folder in (target, _backup(target)):
            try:
                data = (folder / STATE_FILE).read_bytes()
            except (FileNotFoundError, NotADirectoryError):
                continue
            if folder != target:
                logger.warning("%s: an interrupted save left no checkpoint; loading the previous one from %s", target, folder)
            return _parse(folder, data)
        if attempt + 1 < attempts:
            time.sleep(0.05)
    raise FileNotFoundError(f"No {STATE_FILE} in {str(target)!r}: was it written by TTAWrapper.save_pretrained()?")


def _parse(folder: Path, data: bytes) -> Checkpoint:
    path = folder / STATE_FILE
    try:
        (header_len,) = struct.unpack("<Q", data[:8])
        if 8 + header_len > len(data):
            raise ValueError(f"the header claims {header_len} bytes but the file has {len(data)}")
        header = json.loads(data[8 : 8 + header_len])
        meta = json.loads(header.get("__metadata__", {}).get("hf_tta", "{}"))
        if not isinstance(meta, dict):
            raise ValueError("its hf_tta metadata is not a JSON object")
        tensors = load_safetensors(data)
    except Exception as err:  # struct.error, JSONDecodeError, SafetensorError, AttributeError on a non-dict header...
        why = "an empty file" if not data else f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'malformed'}"
        raise CheckpointError(
            f"{path} is not a whole safetensors checkpoint ({why}; {len(data)} bytes): it is damaged or truncated, "
            "re-save it with TTAWrapper.save_pretrained()."
        ) from None
    if meta.get("format", 0) > FORMAT:
        raise ValueError(f"{folder}: checkpoint format {meta['format']} is newer than this hf_tta reads ({FORMAT}): upgrade hf_tta.")
    expected = meta.pop("tensors_sha256", None)
    if expected is None:
        logger.warning("%s has no integrity digest (written by an older hf_tta): loading it unchecked; re-save it to add one", path)
    elif tensors_digest(tensors) != expected:
        raise CheckpointError(
            f"{path}: its tensors do not match the sha256 digest recorded when it was saved (the file was changed or "
            "damaged after saving): re-save it from the wrapper, or restore an intact copy."
        )
    config = meta.pop("config", None)
    if config is None:  # written before the config was embedded in the state file
        try:
            with open(folder / CONFIG_FILE, encoding="utf-8") as fh:
                config = json.load(fh)
        except (OSError, ValueError) as err:
            raise CheckpointError(
                f"{folder / CONFIG_FILE} cannot be read ({type(err).__name__}): re-save it with TTAWrapper.save_pretrained()."
            ) from None
    config.pop("hf_tta_version", None)
    tensors, meta, legacy = _rename_peft_ln(tensors, meta)
    if legacy:
        logger.info("%s names its LayerNorm parameters as PEFT's LN tuning did (%s); read with the model's own names", path, next(iter(legacy.values())))
    return Checkpoint(folder, config, tensors, meta, legacy)


_PEFT_LN = ".ln_tuning_layers.default."  # how LayerNorm tuning through PEFT named an adapted tensor (issue 36 dropped it)


def _rename_peft_ln(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> tuple[dict, dict, dict[str, str]]:
    """A checkpoint written while LayerNorm tuning went through PEFT (``<module>.ln_tuning_layers.default.<param>``)
    read with the model's own names (``<module>.<param>``): its tensors' keys and every name in its metadata (param
    names, fingerprint, the safety snapshot), and the map from each new adapted name to the old."""
    if not any(_PEFT_LN in k for k in tensors):
        return tensors, meta, {}
    old = (meta.get("fingerprint") or {}).get("adapted", {})
    legacy = {n.replace(_PEFT_LN, "."): n for n in old}
    tensors = {k.replace(_PEFT_LN, "."): v for k, v in tensors.items()}
    return tensors, json.loads(json.dumps(meta).replace(_PEFT_LN, ".")), legacy
