"""Audio query corruptions (REST Table A.1, audio: Noise = Gaussian / crowd / traffic, Weather = rain / thunder /
wind), mixed into the waveform at a signal-to-noise ratio (waveform I/O: :mod:`~hf_tta.data.corruptions.audio_io`).

- ``gaussian_noise``: white Gaussian noise.
- ``crowd``, ``traffic``, ``rain``, ``thunder``, ``wind``: a recording of that noise, which **you provide**
  (:class:`NoiseBank`; REST/READ used freely available recordings but do not ship them). The recording is looped
  or cropped at a seeded random offset to the clip's length.

The noise is scaled so that ``10 log10(P_signal / P_noise) = snr_db``, where ``P`` is the mean power over the
corrupted span and ``P_signal`` is that of the *clean* reference (by default the waveform itself; the segment
functions pass the whole clip's power, so a quiet segment still gets the clip's noise level). Severities 1..5 map
to :data:`AUDIO_SEVERITY_SNR_DB` = 10, 5, 0, -5, -10 dB. That table is ours: READ (the same group's earlier
pipeline) adds noise of std 0.08..0.38 to the waveform, which is about +2..-12 dB for a clip at RMS 0.1; REST gives
no values. Pass ``snr_db=`` for any other level. Output is float32, not clipped to [-1, 1].

Everything is vectorised over the samples, and over clips for a ``(B, N)`` batch of equal-length waveforms.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from .audio_io import AUDIO_EXTENSIONS, read_audio
from .base import derive_seed

#: The six audio corruptions of REST Table A.1, with their category.
AUDIO_CORRUPTION_CATEGORIES: dict[str, str] = {
    "gaussian_noise": "noise",
    "crowd": "noise",
    "traffic": "noise",
    "rain": "weather",
    "thunder": "weather",
    "wind": "weather",
}
AUDIO_CORRUPTIONS: tuple[str, ...] = tuple(AUDIO_CORRUPTION_CATEGORIES)
#: Corruptions that mix in a user-provided recording.
ENVIRONMENTAL_NOISES: tuple[str, ...] = ("crowd", "traffic", "rain", "thunder", "wind")
#: One subtype per category for AudioSet-O's "N+W" column: REST names "Windy noise" for Weather; Gaussian noise for
#: Noise is our reading (the paper's bold marks were lost).
AUDIO_REPRESENTATIVES: dict[str, str] = {"noise": "gaussian_noise", "weather": "wind"}
AUDIO_SEVERITY_SNR_DB: dict[int, float] = {1: 10.0, 2: 5.0, 3: 0.0, 4: -5.0, 5: -10.0}


def snr_of(severity: int | None = None, snr_db: float | None = None) -> float:
    """The SNR in dB of a severity (1..5), or ``snr_db`` itself; exactly one must be given."""
    if (severity is None) == (snr_db is None):
        raise ValueError("Give exactly one of `severity` (1..5) and `snr_db`.")
    if snr_db is not None:
        if isinstance(snr_db, bool) or not isinstance(snr_db, (int, float, np.integer, np.floating)) or not np.isfinite(snr_db):
            raise ValueError(f"snr_db must be a finite number of decibels; got {snr_db!r}.")
        return float(snr_db)
    if isinstance(severity, bool) or not isinstance(severity, (int, np.integer)) or int(severity) not in AUDIO_SEVERITY_SNR_DB:
        raise ValueError(f"Audio severity must be one of {list(AUDIO_SEVERITY_SNR_DB)}; got {severity!r}.")
    return AUDIO_SEVERITY_SNR_DB[int(severity)]


def signal_power(waveform: np.ndarray) -> np.ndarray:
    """Mean power over the last axis (float64), ``(...,)``."""
    w = np.asarray(waveform, dtype=np.float64)
    return np.mean(w * w, axis=-1)


class NoiseBank:
    """Recordings of the environmental noises, by corruption name, at one sampling rate.

    Args:
        recordings: name -> one waveform or a list of waveforms (1-D float arrays at ``sampling_rate``).
        sampling_rate: their sampling rate (clips must have the same one).

    Use :meth:`from_directory` to read ``crowd.wav``, ``traffic.flac``, ... (or a folder per name holding several
    recordings) from a folder. :meth:`missing` lists the corruptions it cannot make.
    """

    def __init__(self, recordings: Mapping[str, np.ndarray | Sequence[np.ndarray]], sampling_rate: int):
        self.sampling_rate = int(sampling_rate)
        self.recordings: dict[str, list[np.ndarray]] = {}
        for name, recs in recordings.items():
            if name not in ENVIRONMENTAL_NOISES:
                raise ValueError(f"Unknown environmental noise {name!r}; choose from {list(ENVIRONMENTAL_NOISES)}.")
            recs = [recs] if isinstance(recs, np.ndarray) else list(recs)
            clean = [np.asarray(r, dtype=np.float32).reshape(-1) for r in recs]
            if not clean or any(r.size == 0 or not np.any(r) for r in clean):
                raise ValueError(f"The {name!r} recordings must be non-empty and not silent.")
            self.recordings[name] = clean

    @classmethod
    def from_directory(cls, path: str | os.PathLike, sampling_rate: int) -> "NoiseBank":
        """Read ``<path>/<name>.<ext>`` or ``<path>/<name>/*.<ext>`` for each environmental noise that is there
        (formats: see :func:`read_audio`; ``.npy`` recordings must already be at ``sampling_rate``), resampled to
        ``sampling_rate`` and mixed down to mono."""
        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"No noise-recording folder {str(root)!r}.")
        found: dict[str, list[np.ndarray]] = {}
        for name in ENVIRONMENTAL_NOISES:
            files = sorted(p for p in root.glob(f"{name}.*") if p.suffix.lower() in AUDIO_EXTENSIONS)
            if (root / name).is_dir():
                files += sorted(p for p in (root / name).iterdir() if p.suffix.lower() in AUDIO_EXTENSIONS)
            if files:
                found[name] = [read_audio(f, sampling_rate, npy_sampling_rate=sampling_rate)[0] for f in files]
        return cls(found, sampling_rate)

    @property
    def available(self) -> tuple[str, ...]:
        return tuple(n for n in ENVIRONMENTAL_NOISES if n in self.recordings)

    def missing(self, names: Iterable[str] = ENVIRONMENTAL_NOISES) -> list[str]:
        """The environmental noises among ``names`` that this bank has no recording for."""
        return [n for n in names if n in ENVIRONMENTAL_NOISES and n not in self.recordings]

    def sample(self, name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        """Noise of ``shape`` (last axis = samples): one recording per call, a random offset per row, looped."""
        if name not in self.recordings:
            raise KeyError(
                f"No recording of {name!r} noise: put {name}.wav (or a {name}/ folder) in the noise folder. "
                f"This bank has {list(self.available)}."
            )
        recs = self.recordings[name]
        rec = recs[int(rng.integers(len(recs)))]
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        offsets = rng.integers(0, rec.size, size=(rows, 1))
        idx = (offsets + np.arange(shape[-1])[None, :]) % rec.size
        return rec[idx].reshape(shape)

    def __repr__(self) -> str:
        return f"NoiseBank(sampling_rate={self.sampling_rate}, available={list(self.available)})"


def corrupt_audio(
    waveform: np.ndarray,
    name: str,
    severity: int | None = None,
    *,
    snr_db: float | None = None,
    seed: int | None = None,
    noise_bank: NoiseBank | None = None,
    sampling_rate: int | None = None,
    reference_power: float | np.ndarray | None = None,
) -> np.ndarray:
    """Mix noise into ``waveform`` at an SNR.

    Args:
        waveform: ``(N,)`` or ``(B, N)`` float samples.
        name: one of :data:`AUDIO_CORRUPTIONS`.
        severity / snr_db: the level (exactly one): severity 1..5 (:data:`AUDIO_SEVERITY_SNR_DB`) or dB.
        seed: makes the noise deterministic (``None``: fresh randomness).
        noise_bank: recordings for the environmental noises.
        sampling_rate: the waveform's rate; checked against the bank's when given.
        reference_power: ``P_signal`` (scalar or per row); default the waveform's own mean power.

    Returns:
        float32 array of the same shape. A silent waveform (zero power) stays silent: its noise is scaled to zero.

    Raises:
        ValueError: for an unknown name, a bad level, non-float or non-finite samples, or another shape.
    """
    if name not in AUDIO_CORRUPTIONS:
        raise ValueError(f"Unknown audio corruption {name!r}; choose from {list(AUDIO_CORRUPTIONS)}.")
    snr = snr_of(severity, snr_db)
    raw = np.asarray(waveform)
    if not np.issubdtype(raw.dtype, np.floating):
        raise ValueError(
            f"waveform must hold float samples (about -1..1); got {raw.dtype}. Convert PCM first, e.g. x / 32768 for int16."
        )
    x = raw.astype(np.float32, copy=False)
    if x.ndim not in (1, 2) or x.shape[-1] == 0:
        raise ValueError(f"waveform must be (N,) or (B, N) with N > 0; got shape {x.shape}.")
    if not np.all(np.isfinite(x)):
        raise ValueError("waveform has NaN or infinite samples.")
    rng = np.random.default_rng(None if seed is None else derive_seed(seed, "audio", name))
    if name == "gaussian_noise":
        noise = rng.standard_normal(x.shape)
    else:
        if noise_bank is None:
            raise ValueError(f"{name!r} mixes in a recording: pass noise_bank=NoiseBank.from_directory(...).")
        if sampling_rate is not None and sampling_rate != noise_bank.sampling_rate:
            raise ValueError(f"The waveform is at {sampling_rate} Hz but the noise bank at {noise_bank.sampling_rate} Hz.")
        noise = noise_bank.sample(name, x.shape, rng).astype(np.float64)
    p_signal = signal_power(x) if reference_power is None else np.asarray(reference_power, dtype=np.float64)
    p_noise = np.maximum(signal_power(noise), 1e-20)
    gain = np.sqrt(p_signal / (10.0 ** (snr / 10.0)) / p_noise)
    return (x + noise * np.asarray(gain)[..., None]).astype(np.float32)


__all__ = [
    "AUDIO_CORRUPTIONS",
    "AUDIO_CORRUPTION_CATEGORIES",
    "AUDIO_REPRESENTATIVES",
    "AUDIO_SEVERITY_SNR_DB",
    "ENVIRONMENTAL_NOISES",
    "NoiseBank",
    "corrupt_audio",
    "signal_power",
    "snr_of",
]
