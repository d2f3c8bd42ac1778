"""Helpers shared by several test modules (public names; fixtures are in conftest.py): a harmful test objective,
synthetic galleries and query streams, exact state comparison and the one "resume equals uninterrupted" check."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from hf_tta import GalleryCache, TTAWrapper
from hf_tta.objectives.base import LossOutput, Objective, ObjectiveConfig
from hf_tta.state import ALL, ROLLBACK, AdapterState
from tiny_models import batch, make_model

B = 16
#: Safety thresholds that never fire (the layer runs, nothing is flagged).
QUIET = dict(min_source_diversity=0.0, collapse_ratio=0.0, min_agreement=0.0, max_agreement_drop=1.0)


# ------------------------------------------------------------------------------------- a harmful test objective
@dataclass
class PushConfig(ObjectiveConfig):
    """``mode`` on the batches ``harm_batches``: "collapse" pulls every query to item 0, "shift" pulls each query to
    the item after its own top-1 (predictions change, diversity stays), "nan" gives a NaN loss, "raise" raises; other batches make a
    zero-gradient update (AdamW's step count and weight decay still move)."""

    mode: str = "shift"
    harm_batches: list[int] = field(default_factory=list)


class Push(Objective):
    def init_state(self, device="cpu"):
        return {"calls": torch.zeros((), dtype=torch.int64, device=device)}

    def __call__(self, inputs, state):
        state["calls"] = state["calls"] + 1  # objective state that moves at every step (replaced, never in place)
        s = inputs.scores
        if inputs.batch_index not in self.config.harm_batches:
            return LossOutput(loss=(s * 0).sum(), n_selected=s.shape[0])
        if self.config.mode == "raise":
            raise RuntimeError(f"push: batch {inputs.batch_index}")
        if self.config.mode == "nan":
            return LossOutput(loss=(s * float("nan")).sum(), n_selected=s.shape[0])
        if self.config.mode == "collapse":
            target = torch.zeros(s.shape[0], dtype=torch.long, device=s.device)
        else:
            target = (s.detach().argmax(dim=1) + 1) % s.shape[1]
        return LossOutput(loss=F.cross_entropy(s / 0.01, target), n_selected=s.shape[0])


# ------------------------------------------------------------------------------------- data
def dense_gallery(n: int = 40, dim: int = 16, seed: int = 3) -> GalleryCache:
    g = torch.Generator().manual_seed(seed)
    return GalleryCache(F.normalize(torch.randn(n, dim, generator=g), dim=1), "text")


def image_stream(n: int, seed: int = 100, size: int = B) -> list[dict[str, torch.Tensor]]:
    return [batch("image", size, seed=seed + i) for i in range(n)]


def constant_batch(seed: int = 99, size: int = B) -> dict[str, torch.Tensor]:
    """One image repeated ``size`` times (a frozen camera, a blank frame)."""
    return {"pixel_values": batch("image", 1, seed=seed)["pixel_values"].expand(size, -1, -1, -1).contiguous()}


def style_images(style: int, n: int, seed: int) -> torch.Tensor:
    """Synthetic image "styles": N(0, 1), N(3, 0.1), N(-2, 0.5) pixels (content = the random draw)."""
    g = torch.Generator().manual_seed(seed)
    loc, scale = [(0.0, 1.0), (3.0, 0.1), (-2.0, 0.5)][style]
    return loc + scale * torch.randn(n, 3, 32, 32, generator=g)


def mixed_styles(batch: int, styles=(0, 1), n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of interleaved styles and each query's style."""
    x = torch.cat([style_images(s, n, seed=100 * batch + s) for s in styles])
    label = torch.tensor(styles).repeat_interleave(n)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(batch))
    return x[perm], label[perm]


def style_stream(num_batches: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two styles, then a third from batch 2 on."""
    return [mixed_styles(b, (0, 1) if b < 2 else (0, 1, 2)) for b in range(num_batches)]


def source_scores(tta: TTAWrapper, queries, gallery) -> torch.Tensor:
    with tta.disabled():
        return tta.embed_and_score(queries, gallery)[1]


# ------------------------------------------------------------------------------------- state
def state_of(tta: TTAWrapper | AdapterState) -> dict[str, torch.Tensor]:
    """Every adapted tensor (a wrapper's now, or a captured state): parameters and other optimised tensors, optimiser
    state (by parameter name) and objective state, copied."""
    state = tta if isinstance(tta, AdapterState) else AdapterState.capture(tta, ROLLBACK)
    tensors, meta = state.only(ROLLBACK).to_tensors(optimizer_keys="name")
    out = {k: v.clone() for k, v in tensors.items()}
    for name, plain in meta.get("optim_plain", {}).items():
        out.update({f"optim.{name}.{k}": torch.tensor(v) for k, v in plain.items()})
    return out


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _same_output(a: Any, b: Any) -> None:
    if a.scores is None:
        assert torch.equal(a.topk.indices, b.topk.indices) and torch.equal(a.topk.values, b.topk.values)
    else:
        assert torch.equal(a.scores, b.scores)
    assert (a.loss, a.num_updates, a.skipped, a.safety_action, a.safety_logs) == (
        b.loss, b.num_updates, b.skipped, b.safety_action, b.safety_logs
    )
    if getattr(a, "domains", None) is not None:
        assert torch.equal(a.domains, b.domains) and a.domain_keys == b.domain_keys


def check_resume(
    make: Callable[[], tuple[TTAWrapper, Any]],
    stream: Sequence[Any],
    cut: int,
    folder: Path,
    step: Callable[[TTAWrapper, Any, Any], Any] | None = None,
    model_name: str = "clip",
) -> None:
    """A stream cut after ``cut`` batches, saved, reloaded with ``from_pretrained`` on a fresh source model and
    continued equals the uninterrupted stream: every output and the final state, bit for bit."""
    step = step or (lambda tta, gallery, x: tta.adapt_step(x, gallery))
    whole, gallery = make()
    full = [step(whole, gallery, x) for x in stream]
    first, gallery1 = make()
    for x in stream[:cut]:
        step(first, gallery1, x)
    first.save_pretrained(folder)
    resumed = type(first).from_pretrained(make_model(model_name), folder)
    assert resumed.safety_counts == first.safety_counts
    if not hasattr(first, "domain_keys"):  # a routed wrapper's counters are its domains'
        assert resumed.batch_index == first.batch_index
    _, gallery2 = make()
    for a, x in zip(full[cut:], stream[cut:]):
        _same_output(a, step(resumed, gallery2, x))
    assert whole.safety_counts == resumed.safety_counts
    if whole.safety.active:  # the stream must exercise the monitor across the cut, or the check proves little
        assert first.safety_counts["rollback"] >= 1 and whole.safety_counts["rollback"] > first.safety_counts["rollback"]
    if hasattr(whole, "domain_keys"):
        assert whole.domain_keys == resumed.domain_keys
        theirs = resumed.router.state_tensors()
        assert all(torch.equal(v, theirs[k]) for k, v in whole.router.state_tensors().items())
        for key in whole.domain_keys:
            assert whole.domain_state(key).equals(resumed.domain_state(key)), key
            a, b = whole.domain_monitor(key), resumed.domain_monitor(key)
            if a.active:
                assert (a.agreement_ema, a.kept_in_row, a.rollbacks_in_row) == (b.agreement_ema, b.kept_in_row, b.rollbacks_in_row)
    else:
        assert AdapterState.capture(whole, ALL).equals(AdapterState.capture(resumed, ALL))
        if whole.safety.active:
            a, b = whole.safety, resumed.safety
            assert (a.agreement_ema, a.kept_in_row, a.rollbacks_in_row) == (b.agreement_ema, b.kept_in_row, b.rollbacks_in_row)
            assert a.last_good.equals(b.last_good)


# ------------------------------------------------------------------------------------- processors
def word_level_clip_tokenizer(texts: Sequence[str] = ()):
    """A word-level tokenizer with CLIP's special ids (bos 0, pad 1, eos 2) that survives save/load, knowing the words
    of ``texts`` and of the library's tokenizer check (other words become ``<unk>``).

    (``CLIPTokenizer(vocab=..., merges=[])`` does not: transformers 5 saves a 5-token BPE, under which every caption
    becomes the same ids, and ``hf_tta.models.check_tokenizer`` refuses such a processor.)"""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from hf_tta.models.text_processor import SAMPLE_TEXTS

    words = sorted({w for t in (*texts, *SAMPLE_TEXTS) for w in t.lower().split()})
    vocab = {"<|startoftext|>": 0, "<pad>": 1, "<|endoftext|>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer, tok.pre_tokenizer = normalizers.Lowercase(), pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", 0), ("<|endoftext|>", 2)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|startoftext|>", eos_token="<|endoftext|>", pad_token="<pad>", unk_token="<unk>",
        model_max_length=32,
    )


# --------------------------------------------------------------------------------- spawned gloo workers
@contextlib.contextmanager
def gloo_worker(rank: int, world: int, init_file: str) -> Iterator[None]:
    """The process group of a worker started by ``torch.multiprocessing.spawn``, on one thread.

    On success the worker waits for its peers (a barrier), leaves the group and ends with ``os._exit(0)``, skipping
    the interpreter's teardown: there gloo's threads could race the C++ destructors and abort the process
    ("terminate called without an active exception", SIGABRT), which CI met in one full run of several. On an
    error the group is left and the exception goes on to ``spawn``, which reports it with its traceback."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        yield
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------------- counting passes with hooks
class PassHooks:
    """The query tower's forward passes (a forward hook on the vision model) and backward passes (a gradient hook on
    one adapted tensor) of a wrapper, counted independently of the library's own counters."""

    def __init__(self, tta: TTAWrapper):
        self.forward = self.backward = 0
        tta.model.vision_model.register_forward_hook(lambda *_: self._add("forward"))
        next(iter(tta.params.values())).register_hook(lambda g: self._add("backward"))

    def _add(self, name: str) -> None:
        setattr(self, name, getattr(self, name) + 1)


def wait_for(predicate: Callable[[], bool], timeout: float = 300.0) -> bool:
    """Poll ``predicate`` until true; the bound is generous (a spawned worker imports torch: slow on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()
