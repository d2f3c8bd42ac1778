"""Waveform I/O for the audio benchmarks: lossless float WAV bytes (what the AudioSet builders store), a WAV decoder
with no dependency, resampling, and reading clips from ``.wav``, ``.npy`` or anything FFmpeg decodes (PyAV)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

#: File extensions read as audio (PyAV decodes all but ``.wav`` and ``.npy``).
AUDIO_EXTENSIONS = (".wav", ".npy", ".flac", ".mp3", ".ogg", ".m4a", ".aac", ".opus")

_WAVE_FORMAT_PCM, _WAVE_FORMAT_FLOAT, _WAVE_FORMAT_EXTENSIBLE = 1, 3, 0xFFFE


def encode_wav(waveform: np.ndarray, sampling_rate: int) -> bytes:
    """Lossless mono 32-bit float WAV bytes (what the AudioSet builders store; readable by any decoder)."""
    data = np.asarray(waveform, dtype="<f4").reshape(-1).tobytes()
    fmt = struct.pack("<HHIIHH", _WAVE_FORMAT_FLOAT, 1, int(sampling_rate), int(sampling_rate) * 4, 4, 32)
    fact = struct.pack("<I", len(data) // 4)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"fact" + struct.pack("<I", 4) + fact
    body += b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def decode_wav(data: bytes) -> tuple[np.ndarray, int]:
    """``(mono float32 waveform, sampling_rate)`` from WAV bytes: PCM 8/16/24/32-bit or float 32/64-bit."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError("Not a RIFF/WAVE file.")
    pos, fmt, payload = 12, None, None
    while pos + 8 <= len(data):
        cid, size = data[pos : pos + 4], struct.unpack("<I", data[pos + 4 : pos + 8])[0]
        chunk = data[pos + 8 : pos + 8 + size]
        if cid == b"fmt ":
            fmt = struct.unpack("<HHIIHH", chunk[:16])
            if fmt[0] == _WAVE_FORMAT_EXTENSIBLE and len(chunk) >= 26:
                fmt = (struct.unpack("<H", chunk[24:26])[0],) + fmt[1:]
        elif cid == b"data":
            payload = chunk
        pos += 8 + size + (size & 1)
    if fmt is None or payload is None:
        raise ValueError("The WAV file has no fmt or data chunk.")
    tag, channels, rate, _, _, bits = fmt
    width = bits // 8
    usable = len(payload) - len(payload) % (width * channels)
    raw = np.frombuffer(payload[:usable], dtype=np.uint8)
    if tag == _WAVE_FORMAT_FLOAT and bits in (32, 64):
        x = raw.view("<f4" if bits == 32 else "<f8").astype(np.float32)
    elif tag == _WAVE_FORMAT_PCM and bits == 8:
        x = (raw.astype(np.float32) - 128.0) / 128.0
    elif tag == _WAVE_FORMAT_PCM and bits in (16, 32):
        x = raw.view("<i2" if bits == 16 else "<i4").astype(np.float32) / float(2 ** (bits - 1))
    elif tag == _WAVE_FORMAT_PCM and bits == 24:
        b = raw.reshape(-1, 3).astype(np.int32)
        x = ((b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8).astype(np.float32) / float(2**23)
    else:
        raise ValueError(f"Unsupported WAV encoding (format tag {tag}, {bits} bits).")
    return x.reshape(-1, channels).mean(axis=1).astype(np.float32), int(rate)


def resample(waveform: np.ndarray, orig_rate: int, target_rate: int) -> np.ndarray:
    """Resample the last axis (polyphase with SciPy when installed, else linear interpolation)."""
    if orig_rate == target_rate:
        return np.asarray(waveform, dtype=np.float32)
    try:
        from math import gcd

        from scipy.signal import resample_poly

        g = gcd(int(orig_rate), int(target_rate))
        return resample_poly(waveform, target_rate // g, orig_rate // g, axis=-1).astype(np.float32)
    except ImportError:
        n = waveform.shape[-1]
        m = max(1, int(round(n * target_rate / orig_rate)))
        return np.interp(np.arange(m) * (orig_rate / target_rate), np.arange(n), waveform).astype(np.float32)


def _read_with_av(path: Path, sampling_rate: int | None) -> tuple[np.ndarray, int]:
    try:
        import av
    except ImportError as err:
        raise ImportError(
            f"Reading {path.suffix or 'this'} audio needs PyAV (`pip install 'hf_tta[audio]'`); WAV and .npy need nothing."
        ) from err
    with av.open(str(path)) as container:
        if not container.streams.audio:
            raise ValueError(f"{path} has no audio stream.")
        stream = container.streams.audio[0]
        rate = int(sampling_rate or stream.rate)
        resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
        chunks = [f.to_ndarray().reshape(-1) for frame in container.decode(stream) for f in resampler.resample(frame)]
        chunks += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    return (np.concatenate(chunks) if chunks else np.zeros(0, np.float32)).astype(np.float32), rate


def read_audio(
    path: str | os.PathLike, sampling_rate: int | None = None, npy_sampling_rate: int | None = None
) -> tuple[np.ndarray, int]:
    """Read a clip as ``(mono float32 waveform, sampling_rate)``, resampled to ``sampling_rate`` when given.

    Formats: ``.wav`` (PCM or float, no dependency), ``.npy`` (a 1-D float array; its rate is ``npy_sampling_rate``),
    and with PyAV installed (``hf_tta[audio]``) anything FFmpeg decodes: ``.flac``, ``.mp3``, ``.ogg``, ``.m4a``, and
    the audio track of a video file (``.mp4``, ``.mkv``, ``.webm``, ...).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".wav":
        x, rate = decode_wav(path.read_bytes())
    elif suffix == ".npy":
        if npy_sampling_rate is None:
            raise ValueError(f"{path} is a .npy waveform: give its sampling rate (npy_sampling_rate / the manifest's `sampling_rate`).")
        x, rate = np.load(path).astype(np.float32), int(npy_sampling_rate)
        if x.ndim == 2:  # (channels, samples)
            x = x.mean(axis=0)
    else:
        return _read_with_av(path, sampling_rate)
    if sampling_rate is not None and rate != sampling_rate:
        x, rate = resample(x, rate, sampling_rate), int(sampling_rate)
    return x.reshape(-1).astype(np.float32), rate


__all__ = ["AUDIO_EXTENSIONS", "decode_wav", "encode_wav", "read_audio", "resample"]
