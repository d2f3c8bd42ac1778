"""One TTA stream adapted across processes (``accelerate launch --num_processes P`` or ``torchrun``).

Every process receives the same *global* batch of queries and embeds its shard of it (rows split as
``torch.tensor_split`` splits them); the query embeddings are all-gathered *with their gradient*
(``torch.distributed.nn.functional.all_gather``, as TCR's code does under torchrun), so the objective sees the global
batch on every process and computes the same loss. Backward through the all-gather sums every process's gradient of
that loss into each shard (P identical copies), so after the all-reduce of the adapted parameters' gradients the sum is
divided by P: the update equals the single-process update on the global batch, and parameters, optimiser state and
objective state stay identical on every process. The model is never ``accelerator.prepare``-d: it stays the user's.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn

from .config import TTAConfig
from .models.base import ModelAdapter
from .wrapper import TTAWrapper


def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """Initialise the default process group from the launcher's environment (``accelerate launch`` and ``torchrun`` set
    ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``) if it is not initialised yet; returns
    ``(rank, world_size)``. ``backend`` defaults to ``nccl`` when CUDA is available, ``gloo`` otherwise."""
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RuntimeError(
                "No process group and no RANK/WORLD_SIZE in the environment: start the script with "
                "`accelerate launch --num_processes P script.py` or `torchrun --nproc_per_node P script.py`."
            )
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl" and "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size()


def shard_bounds(batch: int, world: int) -> list[tuple[int, int]]:
    """``[start, end)`` rows of each process, as ``torch.tensor_split`` splits ``batch`` rows into ``world`` parts."""
    base, extra = divmod(batch, world)
    bounds, start = [], 0
    for r in range(world):
        end = start + base + (1 if r < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def all_gather_with_grad(x: torch.Tensor, sizes: list[int], group=None) -> torch.Tensor:
    """Concatenate every process's ``x`` (first dims ``sizes``, in rank order) keeping the autograd graph: rows are padded
    to ``max(sizes)`` for the collective and the padding is dropped afterwards."""
    width = max(sizes)
    pad = width - x.shape[0]
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
    with warnings.catch_warnings():  # torch >= 2.9 marks it deprecated for _functional_collectives (a private module)
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*all_gather is deprecated")
        parts = dist_nn.all_gather(x, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


class DistributedTTAWrapper(TTAWrapper):
    """:class:`~hf_tta.TTAWrapper` adapting one stream across the processes of a ``torch.distributed`` group.

    Call :meth:`adapt_step` on every process with the same global batch (and the same gallery: a dense
    :class:`~hf_tta.GalleryCache`, a single-process top-k backend, or a :class:`~hf_tta.gallery.ShardedGallery`); each
    process embeds ``1/P`` of the queries. Every process returns the same output. :meth:`save_pretrained` writes from
    the main process only; :meth:`from_pretrained` / :meth:`load_state` read on every process.

    The safety layer (``TTAConfig(safety=...)``, part of :meth:`TTAConfig.recommended <hf_tta.TTAConfig.recommended>`)
    runs unchanged: its source forward embeds the shards and all-gathers them like any forward, and it decides from
    the gathered global batch's scores, so every process skips a degenerate batch, rolls back or resets together and
    the monitor's state (saved from the main process with the rest) stays identical. The one-sync fast path
    (``TTAConfig.fast_step``) is off: every step takes the checked loop, with an unfused AdamW.

    Args:
        model: as for :class:`~hf_tta.TTAWrapper` (the same model on every process: the main process's parameters and
            buffers are broadcast once at construction so every process starts from identical weights).
        config (`TTAConfig`, *optional*): as for :class:`~hf_tta.TTAWrapper`; ``gradient_decoupling`` is not supported.
        group: the process group (default: the world).
    """

    runs_lr_search = False  # TTAConfig.lr_search probes one stream in one process
    # every update goes through the loop's gradient all-reduce, so no fast path and an unfused AdamW from the start (the
    # optimiser a reset, the safety layer's reset or SAR's recovery rebuilds: the update rule never changes mid-stream)
    allows_fast_step = False

    def __init__(self, model: nn.Module | ModelAdapter, config: TTAConfig | None = None, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "DistributedTTAWrapper needs an initialised process group: call hf_tta.init_distributed() first."
            )
        if config is not None and config.gradient_decoupling:
            raise ValueError(
                "gradient_decoupling is not supported across processes: use TTAWrapper (one process) for it."
            )
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        super().__init__(model, config)  # the loop: no fast path, the gradient all-reduce (allows_fast_step, reduce_gradients)
        self.forward.embed = self._embed_shard  # every forward embeds this process's shard and all-gathers
        with torch.no_grad():  # identical starting point everywhere
            src = dist.get_global_rank(group, 0) if group is not None else 0
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                dist.broadcast(t.data, src=src, group=group)
        self.capture_source()  # the broadcast weights are the source (and the anchor's reference)

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    def _embed_shard(self, queries: dict) -> torch.Tensor:
        """The global batch's query embeddings, with grad: this process's rows embedded, all processes' gathered."""
        n = next(v.shape[0] for v in queries.values() if isinstance(v, torch.Tensor))
        if n < self.world_size:
            raise ValueError(
                f"The global batch has {n} queries for {self.world_size} processes: use at least one per process."
            )
        bounds = shard_bounds(n, self.world_size)
        start, end = bounds[self.rank]
        local = {k: (v[start:end] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in queries.items()}
        q = self.forward.encode(local)
        return all_gather_with_grad(q, [e - s for s, e in bounds], self.group)

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        """The loop's gradient-reduce hook: the mean over processes of each adapted tensor's gradient, in one collective."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)  # one collective for all adapted tensors
        flat /= self.world_size  # each process's shard gradient carries P copies of the loss (see the module docstring)
        for p, g in zip(params, flat.split([q.numel() for q in params])):
            p.grad = g.view_as(p)

    def save_pretrained(self, save_directory) -> None:
        """Write the state from the main process only (every process holds the same state); all processes wait."""
        if self.is_main_process:
            super().save_pretrained(save_directory)
        dist.barrier(group=self.group)

    def load_state(self, directory) -> None:
        dist.barrier(group=self.group)  # the main process may still be writing
        super().load_state(directory)
