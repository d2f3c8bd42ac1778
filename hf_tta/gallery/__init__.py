"""Gallery backends behind one interface: the dense in-memory default (:class:`hf_tta.GalleryCache`) and the top-k
backends (exact chunked, FAISS, sharded across processes) for galleries too large for a dense score matrix; every
backend and the dense :class:`LiveGallery` change while searched, with stable external ids (:mod:`hf_tta.gallery.ids`)."""

from .base import GalleryBackend, TopKScores, merge_topk
from .cache import GalleryCache
from .chunked import ChunkedGallery
from .faiss_index import PRESETS as FAISS_PRESETS
from .faiss_index import FaissGallery, default_nlist
from .ids import GalleryChange, IdMap
from .live import GallerySnapshot, LiveGallery
from .sharded import ShardedGallery
from .stats import GalleryKMeans, GalleryStatistics

__all__ = [
    "FAISS_PRESETS",
    "ChunkedGallery",
    "FaissGallery",
    "GalleryBackend",
    "GalleryCache",
    "GalleryChange",
    "GalleryKMeans",
    "GallerySnapshot",
    "GalleryStatistics",
    "IdMap",
    "LiveGallery",
    "ShardedGallery",
    "TopKScores",
    "default_nlist",
    "merge_topk",
]
