"""The one-sync fast path of :meth:`TTAWrapper.adapt_step` (``TTAConfig.fast_step``): every step's skip rule
decided on the device and fed to a fused AdamW, one device-to-host transfer per batch."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from .outputs import TTAOutput, float_logs

if TYPE_CHECKING:  # pragma: no cover
    from .gallery.cache import GalleryCache
    from .wrapper import TTAWrapper

logger = logging.getLogger(__name__)


def adapt_deferred(tta: "TTAWrapper", queries: dict, gallery: "GalleryCache") -> "TTAOutput | None":
    """:meth:`TTAWrapper._adapt_checked` with one host sync per batch instead of several per step.

    Each step's skip rule (nothing selected, non-finite loss or gradient) is evaluated on the device and fed to
    the fused AdamW as ``found_inf``, which then leaves parameters, moments and step count untouched, as the
    checked loop does. A step with nothing selected keeps the objective's state, as in the checked loop; after a
    non-finite step the checked loop also rolls the objective's state back, which later steps see: that case
    (rare) restores the snapshot taken here and returns ``None`` so the batch is replayed by the checked loop.
    """
    snapshot = tta._snapshot()
    source_cache: list[torch.Tensor] = tta.safety.source_cache() if tta.safety is not None else []
    flags: list[tuple[int, torch.Tensor]] = []  # (step, 0 update | 1 nothing selected | 2 non-finite loss | 3 grad)
    skipped: dict[int, str] = {}  # skips decided without the device
    res = inputs = scores = None
    for step in range(tta.config.steps):
        inputs = tta._inputs(queries, gallery, step, source_cache)
        previous_state = dict(tta.state)
        res = tta.objective(inputs, tta.state)
        scores = (res.scores if res.scores is not None else inputs.scores).detach()
        n_sel = res.n_selected
        if res.loss is None or not res.loss.requires_grad or (not torch.is_tensor(n_sel) and n_sel == 0):
            reason = tta._skip_reason(res)  # decided on the host (at most one sync, only in these cases)
            if reason.startswith("non-finite"):
                tta.state.clear()
                tta.state.update(previous_state)
            skipped[step] = reason
            continue
        tta.optimizer.zero_grad(set_to_none=True)
        res.loss.backward()
        grads = [p.grad for p in tta.params.values() if p.grad is not None]
        flag = torch.where(torch.isfinite(res.loss.detach()).all(), 0, 2)
        if grads:
            finite_grad = torch.isfinite(torch.stack(torch._foreach_norm(grads))).all()
            flag = torch.where((flag == 0) & ~finite_grad, 3, flag)
        if torch.is_tensor(n_sel):
            flag = torch.where(n_sel == 0, 1, flag)
        tta.optimizer.found_inf = (flag != 0).float()
        try:
            tta.optimizer.step()
        finally:
            del tta.optimizer.found_inf
        tta.optimizer.zero_grad(set_to_none=True)
        flags.append((step, flag))
    # the one sync: step flags, last loss, selected count and logs in one device-to-host transfer
    named = {f"flag.{s}": f for s, f in flags}
    named.update({f"log.{k}": v for k, v in res.logs.items()})
    named["loss"] = res.loss
    named["n_selected"] = res.n_selected
    on_device = {k: v for k, v in named.items() if torch.is_tensor(v) and v.device.type != "cpu"}
    values = {k: v.item() if torch.is_tensor(v) else v for k, v in named.items() if k not in on_device}
    if on_device:
        stacked = torch.stack([v.detach().reshape(()).to(torch.float64) for v in on_device.values()]).tolist()
        values.update(zip(on_device, stacked))
    codes = {s: int(values[f"flag.{s}"]) for s, _ in flags}
    if any(c >= 2 for c in codes.values()):
        tta._restore(snapshot)
        return None
    skipped.update({s: "no query selected" for s, c in codes.items() if c == 1})
    last_loss, n_selected = values["loss"], int(values["n_selected"])
    out_logs = {k[len("log.") :]: v for k, v in values.items() if k.startswith("log.")}
    skipped_list = [f"step {s}: {skipped[s]}" for s in sorted(skipped)]
    if skipped_list:
        logger.info("adapt_step skipped %s", "; ".join(skipped_list))
    return TTAOutput(
        scores=tta._final_scores(queries, gallery, inputs, scores),
        loss=None if res.loss is None else last_loss,
        num_updates=tta.config.steps - len(skipped_list),
        n_selected=n_selected,
        skipped=skipped_list,
        logs=float_logs(out_logs),
    )
