"""A gallery sharded across processes: each process holds ``1/P`` of the items in any local backend; a search runs
on every shard, the per-shard top-k are all-gathered and merged, and candidate embeddings are assembled from their
owners (an all-reduce of rows owned by exactly one process, so the result is exact).

Every call is a collective: all processes must call :meth:`ShardedGallery.search` / :meth:`gather` (and the
whole-gallery :meth:`~GalleryBackend.statistics` / :meth:`~GalleryBackend.kmeans`, computed from every shard's blocks
with all-reduced sums) with the same queries and indices, which is what the one-stream distributed wrapper (:class:`hf_tta.DistributedTTAWrapper`) does
(its query embeddings are all-gathered, so every process holds the global batch).

A live index: :meth:`~GalleryBackend.add`, ``remove`` and ``replace`` are collectives too (every process calls them
with the same ids and embeddings). Every process keeps the global id map; each shard's backend holds its items under
their global ids. New items go to the smallest shard (the lowest rank on ties), at the end of that shard, so the
later shards' positions move up (``GalleryChange.insert_at``); a removal or replacement is done by the shards owning the
ids. A removal that would empty a shard is refused (rebuild the sharded gallery instead).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from .base import GalleryBackend, TopKScores, check_k, merge_topk
from .ids import IdMap


class ShardedGallery(GalleryBackend):
    """Items ``[offset, offset + len(local))`` of a global gallery live in this process's ``local`` backend.

    Args:
        local (`GalleryBackend`): this process's shard (a :class:`ChunkedGallery` or :class:`FaissGallery`); shards
            are concatenated in rank order to form the global gallery.
        k (`int`, *optional*): neighbours per query; default ``local.k``.
        group: the process group (default: the world).
    """

    def __init__(self, local: GalleryBackend, k: int | None = None, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ShardedGallery needs an initialised torch.distributed process group (hf_tta.init_distributed())."
            )
        if isinstance(local, ShardedGallery):
            raise TypeError("The local shard must be a single-process backend, not a ShardedGallery.")
        self.local, self.group = local, group
        self.modality = local.modality
        self.k = check_k(k if k is not None else local.k)
        self.exact = local.exact
        self.num_vectors = local.num_vectors  # a multi-vector shard's items are (Q, D): checked alike on every shard
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        sizes = torch.zeros(self.world, dtype=torch.long)
        sizes[self.rank] = len(local)
        dist.all_reduce(sizes, group=group)
        shape = torch.tensor([local.dim, local.num_vectors or 0], dtype=torch.long)
        dims = torch.zeros(self.world, 2, dtype=torch.long)
        dims[self.rank] = shape
        dist.all_reduce(dims, group=group)
        if (dims != shape).any():
            raise ValueError(f"The shards disagree on the item shape (D, Q or 0): {dims.tolist()}.")
        self._set_sizes(sizes.tolist())
        self._init_ids()

    def _set_sizes(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.offset = sum(self.sizes[: self.rank])
        self._n = sum(self.sizes)

    def _init_ids(self) -> None:
        """The global ids: the shards' ids in rank order; shards that all kept the default ids ``0 .. n_r - 1`` get
        ``offset .. offset + n_r - 1`` (their global positions)."""
        default = torch.tensor([int(self.local.id_map.is_range())], dtype=torch.long, device=self._comm_device())
        dist.all_reduce(default, op=dist.ReduceOp.MIN, group=self.group)
        if bool(default.item()):
            self.local._set_id_map(IdMap(np.arange(self.offset, self.offset + len(self.local), dtype=np.int64)))
            self._set_id_map(IdMap.range(self._n))
            return
        mine = self.local.ids.to(self._comm_device())
        self._set_id_map(IdMap(self._gather_vector(mine).cpu()))

    # ---------------------------------------------------------------------------------------- live index (collectives)
    def _check_change(self, kind: str) -> None:
        self.local._check_change(kind)

    def _owned(self, positions: np.ndarray) -> np.ndarray:
        return (positions >= self.offset) & (positions < self.offset + len(self.local))

    def _add(self, ids: np.ndarray, rows: torch.Tensor) -> int:
        target = int(np.argmin(self.sizes))
        at = sum(self.sizes[: target + 1])
        if self.rank == target:
            self.local.add(ids, rows)
        sizes = list(self.sizes)
        sizes[target] += ids.size
        self._set_sizes(sizes)
        return at

    def _remove(self, positions: np.ndarray, keep: np.ndarray, ids: np.ndarray) -> None:
        bounds = np.cumsum([0, *self.sizes])
        counts = np.bincount(np.searchsorted(bounds, positions, side="right") - 1, minlength=self.world)
        full = np.nonzero(counts >= np.asarray(self.sizes))[0]
        if full.size:  # checked on every process alike (the same global state), before anything moves
            raise ValueError(f"Removing these ids would empty shard {int(full[0])}: rebuild the ShardedGallery instead.")
        mine = self._owned(positions)
        if mine.any():
            self.local.remove(ids[mine])
        self._set_sizes([int(n - c) for n, c in zip(self.sizes, counts)])

    def _replace(self, positions: np.ndarray, ids: np.ndarray, rows: torch.Tensor) -> None:
        mine = self._owned(positions)
        if mine.any():
            self.local.replace(ids[mine], rows[torch.from_numpy(mine).to(rows.device)])

    def __len__(self) -> int:
        return self._n

    @property
    def dim(self) -> int:
        return self.local.dim

    @property
    def device(self) -> torch.device:
        return self.local.device

    def _comm_device(self) -> torch.device:
        return (
            torch.device("cpu")
            if dist.get_backend(self.group) == "gloo"
            else torch.device("cuda", torch.cuda.current_device())
        )

    @torch.no_grad()
    def search(self, queries: torch.Tensor, k: int) -> TopKScores:
        with self.reading():
            return self._search(queries, k)

    def _search(self, queries: torch.Tensor, k: int) -> TopKScores:
        k = min(check_k(k), self._n)
        dev = self._comm_device()
        res = self.local.search(queries, min(k, len(self.local)))
        values = torch.full((queries.shape[0], k), float("-inf"), device=dev)
        indices = torch.full((queries.shape[0], k), -1, dtype=torch.long, device=dev)
        values[:, : res.k] = res.values.to(dev, torch.float32)
        indices[:, : res.k] = res.indices.to(dev) + self.offset
        all_v = [torch.empty_like(values) for _ in range(self.world)]
        all_i = [torch.empty_like(indices) for _ in range(self.world)]
        dist.all_gather(all_v, values, group=self.group)
        dist.all_gather(all_i, indices, group=self.group)
        merged = merge_topk(torch.cat(all_v, 1), torch.cat(all_i, 1), k)  # padding (-inf) never wins: k <= N
        return merged.to(queries.device)

    # ---------------------------------------------------------------------------------------- statistics (collectives)
    def _stat_blocks(self):
        def blocks():
            for start, block in self.local.iter_blocks():
                yield self.offset + start, block

        return blocks

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(self._comm_device())
        dist.all_reduce(y, group=self.group)
        return y.to(x.device)

    def _gather_vector(self, x: torch.Tensor) -> torch.Tensor:
        """Every shard's per-item vector ``(len(local),)``, concatenated in rank order ``(N,)``."""
        dev = self._comm_device()
        padded = torch.zeros(max(self.sizes), dtype=x.dtype, device=dev)
        padded[: x.shape[0]] = x.to(dev)
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[:n] for p, n in zip(parts, self.sizes)]).to(x.device)

    @torch.no_grad()
    def gather(self, indices: torch.Tensor) -> torch.Tensor:
        with self.reading():
            return self._gather(indices)

    def _gather(self, indices: torch.Tensor) -> torch.Tensor:
        dev = self._comm_device()
        ids = indices.to(dev)
        own = (ids >= self.offset) & (ids < self.offset + len(self.local))
        rows = torch.zeros(ids.shape[0], *self.item_shape, device=dev)
        if own.any():
            rows[own] = self.local.gather(ids[own] - self.offset).to(dev, torch.float32)
        dist.all_reduce(rows, group=self.group)  # each row is owned by exactly one process: the sum is exact
        return rows.to(self.local.device)
