"""ClapModel (LAION CLAP and other CLAP checkpoints): audio <-> text retrieval.

Audio queries are ``input_features`` from ``ClapFeatureExtractor`` / ``ClapProcessor`` (log-mel spectrograms of
shape ``(B, 1 or 4, time, mel)``; ``is_longer`` is passed through for the fusion checkpoints). ``get_*_features``
already return L2-normalised projections; hf_tta normalises again, which changes nothing.

**The BatchNorm of the audio tower is not adapted by default.** CLAP's HTSAT audio encoder normalises the input
spectrogram with ``audio_model.audio_encoder.batch_norm`` (an ``nn.BatchNorm2d`` over the mel bins; the fusion
checkpoints add more BatchNorms in their attentional feature-fusion block). TTA leaves every BatchNorm of the
tower alone and adapts its LayerNorms (Swin ``layernorm_before/after``, ``norm``), because:

- the papers adapt "the LayerNorm layers of the query encoder" (TCR/REST), and TCR's code hands only
  ``nn.LayerNorm`` parameters to the optimiser;
- the wrapper keeps the model in eval mode, so a BatchNorm normalises with the running statistics of the source
  data and never re-estimates them on the test batch: the Tent-style use of BatchNorm (batch statistics) is not
  what would happen; only its affine ``weight``/``bias`` would move;
- that affine pair is a per-mel-bin gain and offset on the input spectrogram, shared by all queries: an entropy
  objective can reach a confident but degenerate solution by re-weighting the input frequencies before any
  representation is computed, which is exactly what LN-only TTA is meant to avoid;
- PEFT's LN-tuning wraps a selected layer in a deep copy, so adapting it is possible and safe to undo.

To adapt it anyway, name it: ``TTAConfig(tuning=TuningConfig(target_modules=[... LayerNorm names ..., "audio_model.audio_encoder.batch_norm"]))``
(see :meth:`ClapAdapter.norm_layer_names`); its running statistics stay those of the source model (eval mode).
"""

from __future__ import annotations

import torch
from torch import nn

from .base import ModelAdapter, pooled, register_adapter
from .inputs import FEATURES, MASK, InputSpec


@register_adapter
class ClapAdapter(ModelAdapter):
    architectures = ("ClapModel",)
    modalities = ("audio", "text")
    input_names = {
        "audio": ("input_features", "is_longer", "attention_mask"),
        "text": ("input_ids", "attention_mask", "position_ids"),
    }
    towers = {"audio": ("audio_model", "audio_projection"), "text": ("text_model", "text_projection")}
    # No paper adapts CLAP. Audio queries take the rate of the papers' non-text query towers (3e-4); the RoBERTa
    # text tower takes TCR's rate for BERT-style text towers (BLIP, 3e-5).
    default_lr = {"audio": 3e-4, "text": 3e-5}
    processors = {"audio": "ClapProcessor / ClapFeatureExtractor", "text": "ClapProcessor / RobertaTokenizer"}

    def input_specs(self, modality: str) -> dict[str, InputSpec]:
        """Audio: log-mel ``input_features`` ``(B, C, time, mel)``; C = 4 for the fusion checkpoints (the global mel
        and three local crops, with ``is_longer`` required), else ``audio_config.patch_embed_input_channels``;
        mel = ``audio_config.num_mel_bins`` (the input BatchNorm's width)."""
        if modality != "audio":
            return super().input_specs(modality)
        audio = self.model.config.audio_config
        channels = 4 if audio.enable_fusion else audio.patch_embed_input_channels
        source = "audio_config.enable_fusion=True" if audio.enable_fusion else f"audio_config.patch_embed_input_channels={channels}"
        proc = self.processors["audio"]
        sizes = ((1, channels, source), (3, audio.num_mel_bins, f"audio_config.num_mel_bins={audio.num_mel_bins}"))
        return {
            "input_features": InputSpec(FEATURES, ("B", "C", "time", "mel"), sizes, processor=proc, description="log-mel features"),
            "is_longer": InputSpec(MASK, processor=proc, required=audio.enable_fusion),
            "attention_mask": InputSpec(MASK, processor=proc),
        }

    def norm_layer_names(self, modality: str) -> list[str]:
        """The tower's normalisation layers without its BatchNorms (see the module docstring)."""
        modules = dict(self.model.named_modules())
        return [n for n in super().norm_layer_names(modality) if not isinstance(modules[n], nn.modules.batchnorm._BatchNorm)]

    def _embed(self, modality: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if modality == "audio":
            return pooled(self.model.get_audio_features(**inputs))
        return pooled(self.model.get_text_features(**inputs))
