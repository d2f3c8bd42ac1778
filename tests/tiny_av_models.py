"""Tiny audio/video models for the audio-video tests: CLAP and X-CLIP built from configs (no weights downloaded),
a CAV-MAE-shaped video-audio dual encoder, and synthetic waveforms / frame stacks."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tiny_models import IDS, TXT, VIS

CLAP_AUDIO = dict(
    num_mel_bins=16, spec_size=32, window_size=4, patch_size=2, patch_stride=2, patch_embeds_hidden_size=16,
    hidden_size=32, depths=[1, 1], num_attention_heads=[2, 2], projection_dim=16,
)
XCLIP_FRAMES = 4


def tiny_clap(seed: int = 0):
    from transformers import ClapConfig, ClapModel

    torch.manual_seed(seed)
    cfg = ClapConfig(projection_dim=16, text_config=dict(TXT, projection_dim=16), audio_config=CLAP_AUDIO)
    return ClapModel(cfg).eval()  # Model(config) is in train mode: CLAP audio is nondeterministic there


def tiny_xclip(seed: int = 0):
    from transformers import XCLIPConfig, XCLIPModel

    torch.manual_seed(seed)
    vision = dict(VIS, num_frames=XCLIP_FRAMES, mit_hidden_size=16, mit_intermediate_size=32, mit_num_attention_heads=2)
    cfg = XCLIPConfig(text_config={**TXT, **IDS}, projection_dim=16, prompt_num_attention_heads=2, vision_config=vision)
    return XCLIPModel(cfg).eval()


def tiny_clip(seed: int = 0):
    from tiny_models import tiny_clip as build

    torch.manual_seed(seed)
    return build().eval()


# ------------------------------------------------------------------------------------------------ CAV-MAE-shaped
class Block(nn.Module):
    """CAV-MAE's block: shared attention/MLP, one pair of LayerNorms per modality (and a joint pair)."""

    def __init__(self, dim: int, heads: int = 2):
        super().__init__()
        self.norm1, self.norm1_a, self.norm1_v = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.norm2, self.norm2_a, self.norm2_v = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, modality=None):
        n1, n2 = {None: (self.norm1, self.norm2), "a": (self.norm1_a, self.norm2_a), "v": (self.norm1_v, self.norm2_v)}[modality]
        h = n1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(n2(x))


class TinyCAVMAE(nn.Module):
    """The attribute names and the retrieval path of CAV-MAE (``forward_feat``), at toy size: audio is a log-mel
    fbank ``(B, time, mel)``, video a single frame ``(B, 3, H, W)``."""

    def __init__(self, dim: int = 16, audio_len: int = 32, mel: int = 16, image: int = 16, patch: int = 8, depth: int = 1):
        super().__init__()
        self.patch_embed_a = nn.Conv2d(1, dim, patch, patch)
        self.patch_embed_v = nn.Conv2d(3, dim, patch, patch)
        self.pos_embed_a = nn.Parameter(torch.randn(1, (audio_len // patch) * (mel // patch), dim) * 0.02)
        self.pos_embed_v = nn.Parameter(torch.randn(1, (image // patch) ** 2, dim) * 0.02)
        self.modality_a = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.modality_v = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.blocks_a = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.blocks_v = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.blocks_u = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.norm_a, self.norm_v, self.norm = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward_feat(self, a, v):
        a = self.patch_embed_a(a.unsqueeze(1).transpose(2, 3)).flatten(2).transpose(1, 2) + self.pos_embed_a + self.modality_a
        v = self.patch_embed_v(v).flatten(2).transpose(1, 2) + self.pos_embed_v + self.modality_v
        for blk in self.blocks_a:
            a = blk(a)
        for blk in self.blocks_v:
            v = blk(v)
        for blk in self.blocks_u:
            a = blk(a, "a")
        a = self.norm_a(a)
        for blk in self.blocks_u:
            v = blk(v, "v")
        return a, self.norm_v(v)


def tiny_cav_mae(seed: int = 0) -> TinyCAVMAE:
    torch.manual_seed(seed)
    return TinyCAVMAE().eval()


def cav_mae_adapter(model):
    """Exactly the recipe for a CAV-MAE checkpoint in model_cards/architecture.md (the toy model has CAV-MAE's attribute names)."""
    from hf_tta import DualEncoderAdapter

    def encode_audio(m, x):  # (B, time, mel) log-mel fbank
        a = m.patch_embed_a(x["input_values"].unsqueeze(1).transpose(2, 3)).flatten(2).transpose(1, 2)
        a = a + m.pos_embed_a + m.modality_a
        for blk in m.blocks_a:
            a = blk(a)
        for blk in m.blocks_u:
            a = blk(a, "a")
        return m.norm_a(a).mean(dim=1)

    def encode_video(m, x):  # (B, T, 3, H, W): CAV-MAE embeds a frame; a video is the mean over its frames
        b, t = x["pixel_values"].shape[:2]
        v = m.patch_embed_v(x["pixel_values"].flatten(0, 1)).flatten(2).transpose(1, 2)
        v = v + m.pos_embed_v + m.modality_v
        for blk in m.blocks_v:
            v = blk(v)
        for blk in m.blocks_u:
            v = blk(v, "v")
        return m.norm_v(v).mean(dim=1).view(b, t, -1).mean(dim=1)

    n_u = len(model.blocks_u)
    return DualEncoderAdapter(
        model,
        encoders={"video": encode_video, "audio": encode_audio},
        towers={
            "audio": ["patch_embed_a", "blocks_a", "norm_a"] + [f"blocks_u.{i}.norm{j}_a" for i in range(n_u) for j in (1, 2)],
            "video": ["patch_embed_v", "blocks_v", "norm_v"] + [f"blocks_u.{i}.norm{j}_v" for i in range(n_u) for j in (1, 2)],
        },
        input_names={"audio": ["input_values"], "video": ["pixel_values"]},
    )


# ------------------------------------------------------------------------------------------------ inputs
def waveforms(n: int, length: int = 4000, sampling_rate: int = 8000, seed: int = 0) -> np.ndarray:
    """``(n, length)`` float32 tones with a little noise (distinct pitch per clip)."""
    rng = np.random.default_rng(seed)
    t = np.arange(length) / sampling_rate
    freqs = rng.uniform(150, 1500, size=(n, 1))
    return (0.5 * np.sin(2 * np.pi * freqs * t) + 0.05 * rng.standard_normal((n, length))).astype(np.float32)


def frame_stacks(n: int, frames: int = 4, size: int = 32, seed: int = 0) -> np.ndarray:
    """``(n, frames, size, size, 3)`` uint8 videos (a moving gradient per clip)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=(n, 1, 1, 1, 3))
    ramp = np.arange(size)[None, None, :, None, None] * 4 + np.arange(frames)[None, :, None, None, None] * 16
    noise = rng.integers(0, 32, size=(n, frames, size, size, 3))
    return ((base + ramp + noise) % 256).astype(np.uint8)


def clap_audio_batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"input_features": torch.randn(n, 1, 64, CLAP_AUDIO["num_mel_bins"], generator=g)}


def video_batch(n: int, frames: int = XCLIP_FRAMES, seed: int = 0, size: int = 32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(n, frames, 3, size, size, generator=g)}
