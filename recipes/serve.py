"""A reference retrieval service that adapts while it serves: FastAPI + uvicorn around :class:`hf_tta.serving.OnlineRetriever`.

FastAPI because it is the well-kept default for Python model services: sync endpoints run in a thread pool (so one
slow answer does not block the others, and the adapting worker thread runs beside them), request bodies are validated
by pydantic (garbage in gets a 422 naming the field), and its ``TestClient`` drives the real app over HTTP in tests.

Endpoints:

* ``POST /search`` ``{"image": <base64 PNG/JPEG>}`` or ``{"text": "..."}`` (the wrapper's query modality), ``"k"``:
  answers with the current model (``ids``, ``scores``, the published state ``version`` and the gallery version);
  header ``X-Tenant: <key>`` picks the tenant's adapter (``--tenants``: a ``RoutedTTAWrapper``; without the header a
  query is the tenant ``default``).
* ``POST /items`` ``{"id": 7, "text": "..."}`` (or ``"image"``): encodes the item with the source gallery tower and
  adds it to the live gallery (409 if the id exists); ``DELETE /items/{id}`` removes it (404 if unknown).
* ``GET /health``: batches adapted, safety counts, last action, the current state's version and fingerprint, the
  gallery's size and version, the last checkpoint.

State: with ``state_dir`` the adapted state is saved to ``state_dir/adapter`` (``save_pretrained``: atomic) and the
live gallery to ``state_dir/gallery.safetensors`` (written beside it and renamed: atomic), every
``checkpoint_every`` seconds and on shutdown; a service started on the same ``state_dir`` resumes from them.

Run the emoji benchmark's model on 127.0.0.1 (image queries, its captions as the gallery)::

    python recipes/serve.py --state-dir /tmp/hf_tta_serve --port 8000
    python recipes/serve.py --no-adapt  # the same service, answering only
"""

from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import io
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from pydantic import BaseModel, Field

from hf_tta import TTAConfig, TTAWrapper
from hf_tta.gallery.live import LiveGallery
from hf_tta.routing import RoutedTTAWrapper
from hf_tta.serving import OnlineRetriever, frozen_copy

logger = logging.getLogger("hf_tta.recipes.serve")

DEFAULT_TENANT = "default"
ADAPTER_DIR, GALLERY_FILE = "adapter", "gallery.safetensors"


@dataclass
class ServiceConfig:
    """What the service is built from. ``encode["image"]`` takes a list of PIL images, ``encode["text"]`` a list of
    strings (padded to a fixed length, so that buffered queries batch); each returns the model's input dict."""

    model_factory: Callable[[], torch.nn.Module]
    tta_config: TTAConfig
    encode: dict[str, Callable[[list], dict[str, torch.Tensor]]]
    gallery_items: Sequence[Any]  # the starting gallery (gallery-modality inputs for encode), ids 0..N-1
    state_dir: str | None = None
    tenants: bool = False
    adapt: bool = True
    batch_size: int = 64
    max_wait: float = 0.05
    mode: str = "background"
    checkpoint_every: float = 300.0
    worker_nice: int = 10


class Service:
    """The model, live gallery and online retriever behind the app (built by :meth:`start`, saved by :meth:`stop`)."""

    def __init__(self, cfg: ServiceConfig):
        self.cfg = cfg
        self.retriever: OnlineRetriever | None = None
        self.gallery: LiveGallery | None = None
        self.last_checkpoint: float | None = None
        self.resumed = False
        self._stop_timer = threading.Event()
        self._timer: threading.Thread | None = None
        self._items_lock = threading.Lock()
        self._encoder: TTAWrapper | None = None  # a private copy that encodes new items (its source gallery tower)

    @property
    def state_dir(self) -> Path | None:
        return Path(self.cfg.state_dir) if self.cfg.state_dir else None

    def start(self) -> None:
        cfg = self.cfg
        cls = RoutedTTAWrapper if cfg.tenants else TTAWrapper
        adapter_dir = self.state_dir / ADAPTER_DIR if self.state_dir else None
        if adapter_dir is not None and (adapter_dir / "tta_config.json").exists():
            wrapper = cls.from_pretrained(cfg.model_factory(), adapter_dir)
            self.resumed = True
            logger.info("Resumed the adapted state from %s (config from the checkpoint).", adapter_dir)
        else:
            wrapper = cls(cfg.model_factory(), cfg.tta_config)
        gallery_file = self.state_dir / GALLERY_FILE if self.state_dir else None
        if gallery_file is not None and gallery_file.exists():
            from safetensors.torch import load_file

            saved = load_file(str(gallery_file))
            self.gallery = LiveGallery(saved["embeddings"], wrapper.gallery_modality, ids=saved["ids"])
            logger.info("Resumed the gallery (%d items) from %s.", len(self.gallery), gallery_file)
        else:
            self.gallery = LiveGallery(self.encode_items(wrapper, list(cfg.gallery_items)), wrapper.gallery_modality)
        self._encoder = frozen_copy(wrapper)  # never answers: its disabled() cannot touch an answer's model
        self.retriever = OnlineRetriever(
            wrapper, self.gallery, batch_size=cfg.batch_size, max_wait=cfg.max_wait, mode=cfg.mode, adapt=cfg.adapt,
            worker_nice=cfg.worker_nice,
        )
        if self.state_dir is not None and cfg.checkpoint_every > 0:
            self._timer = threading.Thread(target=self._checkpoint_loop, name="hf_tta-serve-checkpoint", daemon=True)
            self._timer.start()

    def encode_items(self, wrapper: TTAWrapper, items: list) -> torch.Tensor:
        inputs = self.cfg.encode[wrapper.gallery_modality](items)
        return wrapper.encode_gallery(inputs, show_progress=False).embeddings

    def _checkpoint_loop(self) -> None:
        while not self._stop_timer.wait(self.cfg.checkpoint_every):
            try:
                self.checkpoint()
            except Exception:  # noqa: BLE001 - a failed save is logged; the service goes on and retries next time
                logger.exception("Periodic checkpoint failed")

    def checkpoint(self) -> None:
        """Save the adapted state and the gallery under ``state_dir`` (each atomically)."""
        if self.state_dir is None:
            return
        from safetensors.torch import save_file

        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.retriever.checkpoint(self.state_dir / ADAPTER_DIR)
        snap = self.gallery.snapshot()
        tmp = self.state_dir / f".{GALLERY_FILE}.tmp"
        save_file({"embeddings": snap.cache.embeddings.contiguous(), "ids": snap.ids.contiguous()}, str(tmp))
        os.replace(tmp, self.state_dir / GALLERY_FILE)
        self.last_checkpoint = time.time()
        logger.info("Checkpoint written to %s (state version %d).", self.state_dir, self.retriever.published.version)

    def stop(self) -> None:
        self._stop_timer.set()
        if self._timer is not None:
            self._timer.join()
        if self.retriever is not None:
            self.retriever.close()
            self.checkpoint()

    # ------------------------------------------------------------------------------------------ requests
    def decode(self, modality: str, image: str | None, text: str | None) -> list:
        given = {"image": image, "text": text}
        if given[modality] is None or given["text" if modality == "image" else "image"] is not None:
            raise ValueError(f"send exactly one {modality!r} field: this service's {'queries' if modality == self.retriever.wrapper.query_modality else 'items'} are {modality}s")
        if modality == "text":
            if not text.strip():
                raise ValueError("text is empty")
            return [text]
        from PIL import Image, UnidentifiedImageError

        try:
            return [Image.open(io.BytesIO(base64.b64decode(image, validate=True))).convert("RGB")]
        except (binascii.Error, UnidentifiedImageError, OSError) as err:
            raise ValueError(f"image is not a base64-encoded image file ({err})") from None

    def tenant(self, header: str | None) -> str | None:
        if not self.cfg.tenants:
            if header is not None:
                raise ValueError("X-Tenant given, but this service has no per-tenant adapters (start it with --tenants)")
            return None
        return header or DEFAULT_TENANT


class SearchRequest(BaseModel):
    image: str | None = None  # base64 of an image file (PNG, JPEG, ...)
    text: str | None = None
    k: int = Field(10, ge=1, le=1000)


class ItemRequest(BaseModel):
    id: int
    image: str | None = None
    text: str | None = None


def create_app(cfg: ServiceConfig):
    """The FastAPI app (the service starts with the app's lifespan and saves on shutdown)."""
    from fastapi import FastAPI, Header, HTTPException

    service = Service(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.start()
        try:
            yield
        finally:
            service.stop()

    app = FastAPI(title="hf_tta online retrieval", lifespan=lifespan)
    app.state.service = service

    def bad(err: Exception) -> HTTPException:
        return HTTPException(status_code=400, detail=str(err))

    @app.post("/search")
    def search(req: SearchRequest, x_tenant: str | None = Header(None)) -> dict[str, Any]:
        r = service.retriever
        try:
            items = service.decode(r.wrapper.query_modality, req.image, req.text)
            tenant = service.tenant(x_tenant)
            hits = r.search(cfg.encode[r.wrapper.query_modality](items), k=req.k, tenant=tenant)
        except (ValueError, TypeError) as err:
            raise bad(err) from None
        return {
            "ids": hits.ids[0].tolist(), "scores": hits.values[0].tolist(), "version": hits.version,
            "gallery_version": hits.gallery_version, "tenant": tenant,
        }

    @app.post("/items", status_code=201)
    def add_item(req: ItemRequest) -> dict[str, Any]:
        wrapper = service.retriever.wrapper
        try:
            items = service.decode(wrapper.gallery_modality, req.image, req.text)
            with service._items_lock:  # the source gallery tower never changes: encoding beside adaptation is safe
                emb = service.encode_items(service._encoder, items)
                if req.id in set(service.gallery.ids.tolist()):
                    raise HTTPException(status_code=409, detail=f"item {req.id} exists: DELETE it first")
                service.gallery.add([req.id], emb)
        except (ValueError, TypeError) as err:
            raise bad(err) from None
        return {"id": req.id, "gallery_size": len(service.gallery), "gallery_version": service.gallery.version}

    @app.delete("/items/{item_id}")
    def delete_item(item_id: int) -> dict[str, Any]:
        with service._items_lock:
            if item_id not in set(service.gallery.ids.tolist()):
                raise HTTPException(status_code=404, detail=f"no item {item_id}")
            try:
                service.gallery.remove([item_id])
            except ValueError as err:
                raise bad(err) from None
        return {"id": item_id, "gallery_size": len(service.gallery), "gallery_version": service.gallery.version}

    @app.get("/health")
    def health() -> dict[str, Any]:
        stats = service.retriever.stats()
        return {
            **stats, "status": "ok" if stats["worker_error"] is None else "error", "resumed": service.resumed,
            "gallery_size": len(service.gallery), "gallery_version": service.gallery.version,
            "last_checkpoint": service.last_checkpoint, "tenants": cfg.tenants,
        }

    return app


# ---------------------------------------------------------------------------------------------- the emoji model
def emoji_service_config(**kw: Any) -> ServiceConfig:
    """The emoji benchmark's shipped source model (image queries, its captions as the gallery)."""
    from hf_tta.benchmarks import load_emoji_benchmark
    from hf_tta.benchmarks.source_model import input_side, load_emoji_source_model, preprocess_images

    model, tokenizer = load_emoji_source_model()
    side = input_side(model)

    def text(texts: list[str]) -> dict[str, torch.Tensor]:
        return dict(tokenizer(list(texts), padding="max_length", truncation=True, max_length=32, return_tensors="pt"))

    def image(images: list) -> dict[str, torch.Tensor]:
        return {"pixel_values": preprocess_images(images, size=side)}

    state = {"model": model}

    def model_factory() -> torch.nn.Module:  # the first build is reused; a second service reloads the weights
        return state.pop("model", None) or load_emoji_source_model()[0]

    bench = load_emoji_benchmark()
    tta = TTAConfig(objective="tcr", query_modality="image", safety={})
    return ServiceConfig(model_factory, tta, {"image": image, "text": text}, bench.captions, **kw)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--state-dir", default=None, help="checkpoint folder (resumed when it exists)")
    p.add_argument("--checkpoint-every", type=float, default=300.0, help="seconds between checkpoints (0: on shutdown only)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-wait", type=float, default=0.05)
    p.add_argument("--tenants", action="store_true", help="per-tenant adapters (X-Tenant header)")
    p.add_argument("--worker-nice", type=int, default=10, help="nice increment of the adapting thread (0: none)")
    p.add_argument("--no-adapt", dest="adapt", action="store_false", help="answer only (the baseline)")
    args = p.parse_args(argv)
    import uvicorn

    logging.basicConfig(level=logging.INFO)
    cfg = emoji_service_config(
        state_dir=args.state_dir, checkpoint_every=args.checkpoint_every, batch_size=args.batch_size,
        max_wait=args.max_wait, tenants=args.tenants, adapt=args.adapt, worker_nice=args.worker_nice,
    )
    uvicorn.run(create_app(cfg), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
