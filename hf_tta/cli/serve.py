"""``hf-tta serve``: the retrieval service that adapts while it serves (``hf_tta.service``, FastAPI + uvicorn).

The answering process answers every query at once from the published adapted state; a separate adapting process
(spawned) adapts on the queries in micro-batches and publishes each new state through shared memory (or Redis with
``--store``). See ``model_cards/serving.md`` for the endpoints, the topology and the measured latencies.

    hf-tta serve --state-dir /tmp/hf_tta_serve --port 8000             # the emoji benchmark's model
    hf-tta serve --model ./my-clip --config tta.yaml --gallery captions.txt --state-dir /srv/tta
    hf-tta serve --no-adapt                                             # the same service, answering only
    hf-tta serve --recommended --gate-reference clean_photos/ --state-dir /srv/tta   # the library's default
    HF_TTA_SERVICE_TOKEN=... hf-tta serve --tenants --max-tenants 32    # gallery edits and admin need it

``recipes/serve.py`` is a thin caller of :func:`main` (the same options).

Exit code 2 with one line on a bad argument (a config that does not load, a missing gallery file, ...).
"""

from __future__ import annotations

import argparse
import logging
from functools import partial
from typing import Any, Sequence

from hf_tta import TTAConfig
from hf_tta.service.app import create_app
from hf_tta.service.auth import load_token
from hf_tta.service.builders import build_wrapper, load_config, pretrained_encoders, pretrained_model
from hf_tta.service.limits import Limits
from hf_tta.service.service import ServiceConfig

logger = logging.getLogger("hf_tta.serve")

DEFAULT_TTA = {"objective": "tcr", "query_modality": "image", "safety": {}}


def emoji_model():
    """The emoji benchmark's shipped source model (module level: the spawned adapting process unpickles it by name)."""
    from hf_tta.benchmarks.source_model import load_emoji_source_model

    return load_emoji_source_model()[0]


def emoji_encoders() -> dict[str, Any]:
    """The emoji model's input encoders (its tokenizer, padded to 32 tokens; images resized to its input side)."""
    from hf_tta.benchmarks.source_model import load_tokenizer, preprocess_images, weights_input_side

    tokenizer, side = load_tokenizer(), weights_input_side()

    def text(texts: list[str]):
        return dict(tokenizer(list(texts), padding="max_length", truncation=True, max_length=32, return_tensors="pt"))

    def image(images: list):
        return {"pixel_values": preprocess_images(images, size=side)}

    return {"image": image, "text": text}


#: image files ``--gate-reference`` reads from a folder
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def gate_reference_items(path: str, modality: str, minimum: int) -> list:
    """``--gate-reference``'s clean queries: a folder of images (image queries) or a text file, one query per line;
    at least ``minimum`` of them (``ShiftGateConfig.min_reference``)."""
    from pathlib import Path

    where = Path(path)
    if modality == "image":
        if not where.is_dir():
            raise ValueError(f"--gate-reference {path}: not a folder (image queries need a folder of clean images)")
        from PIL import Image

        files = sorted(f for f in where.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
        items = [Image.open(f).convert("RGB") for f in files]
    else:
        if not where.is_file():
            raise ValueError(f"--gate-reference {path}: not a file (text queries need a file, one clean query per line)")
        items = [line.rstrip("\n") for line in where.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(items) < minimum:
        raise ValueError(f"--gate-reference {path} holds {len(items)} {modality} queries; the shift gate needs at least "
                         f"{minimum} clean ones (ShiftGateConfig.min_reference), a few hundred is better")
    return items


def tta_config(args: argparse.Namespace) -> TTAConfig:
    """The served ``TTAConfig``: ``--config``, ``--recommended`` (the library's default for image queries) or TCR with
    the safety layer."""
    if args.config and args.recommended:
        raise ValueError("--config and --recommended both name the TTAConfig: pass one")
    if args.recommended:
        return TTAConfig.recommended("image")
    return load_config(args.config) if args.config else TTAConfig(**DEFAULT_TTA)


def build_config(args: argparse.Namespace) -> ServiceConfig:
    tta = tta_config(args)
    if args.model and not args.gallery:
        raise ValueError("--model needs --gallery (a text file, one gallery caption per line)")
    if args.gallery:
        with open(args.gallery, encoding="utf-8") as fh:
            items = [line.rstrip("\n") for line in fh if line.strip()]
        if not items:
            raise ValueError(f"{args.gallery} holds no gallery items")
    else:
        from hf_tta.benchmarks import load_emoji_benchmark

        items = load_emoji_benchmark().captions
    if args.model:
        factory, encode = partial(pretrained_model, args.model), pretrained_encoders(args.model)
    else:
        factory, encode = emoji_model, emoji_encoders()
    reference = None
    if args.gate_reference:
        if tta.shift_gate is None:
            raise ValueError("--gate-reference fits the shift gate, which this TTAConfig does not have: add shift_gate "
                             "to --config, or pass --recommended")
        minimum = tta.build_shift_gate_config().min_reference
        inputs = encode[tta.query_modality](gate_reference_items(args.gate_reference, tta.query_modality, minimum))
        # fitted once here: every process that builds the wrapper gets the statistics, not the images' tensors
        reference = build_wrapper(factory, tta, inputs).shift_gate.state_tensors()
    elif tta.shift_gate is not None and args.adapt:
        logger.warning("the TTAConfig has a shift gate and no --gate-reference: until it is fitted the source model "
                       "answers every query and nothing adapts (pass --gate-reference with clean queries)")
    limits = Limits(max_body_bytes=int(args.max_body_mb * 2**20), max_pixels=args.max_pixels, timeout=args.timeout)
    return ServiceConfig(
        partial(build_wrapper, factory, tta, None, reference), encode, items, state_dir=args.state_dir, tenants=args.tenants,
        max_tenants=args.max_tenants, adapt=args.adapt, batch_size=args.batch_size, min_batch=args.min_batch,
        max_wait=args.max_wait, queue_capacity=args.queue_capacity, checkpoint_every=args.checkpoint_every,
        worker_nice=args.worker_nice, worker_idle=args.worker_idle, max_state_lag=args.max_state_lag, limits=limits,
        adapt_yield=None if args.adapt_yield < 0 else args.adapt_yield,
        token=load_token(file=args.token_file), search_needs_token=args.search_needs_token, store=args.store,
    )


class OneLineParser(argparse.ArgumentParser):
    """An argument mistake is one line naming it (no usage dump) and exit status 2, as ``hf-tta``'s other commands."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description=__doc__.split("\n")[0].strip("`"))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="a dual-encoder checkpoint (folder or Hub id; default: the emoji model)")
    p.add_argument("--config", default=None, help="a TTAConfig as JSON or YAML (default: TCR on the image tower, safety on)")
    p.add_argument("--recommended", action="store_true",
                   help="serve TTAConfig.recommended('image'), the library's default (it needs --gate-reference)")
    p.add_argument("--gate-reference", default=None,
                   help="clean, in-distribution queries that fit the shift gate: a folder of images (image queries) "
                        "or a text file, one query per line")
    p.add_argument("--gallery", default=None, help="text file, one gallery caption per line (default: the emoji captions)")
    p.add_argument("--state-dir", default=None, help="checkpoint folder (resumed when it exists)")
    p.add_argument("--checkpoint-every", type=float, default=30.0, help="seconds between checkpoints (0: on shutdown only)")
    p.add_argument("--batch-size", type=int, default=32, help="adapt when a tenant has this many queries queued")
    p.add_argument("--min-batch", type=int, default=8, help="or this many once the oldest waited --max-wait (the safety layer judges >= 8)")
    p.add_argument("--max-wait", type=float, default=1.0)
    p.add_argument("--queue-capacity", type=int, default=512, help="queries waiting for adaptation; the oldest are dropped past it")
    p.add_argument("--tenants", action="store_true", help="per-tenant adapters (X-Tenant header)")
    p.add_argument("--max-tenants", type=int, default=8,
                   help="tenants with their own adapted state; 'default' (requests without X-Tenant) counts once used")
    p.add_argument("--worker-nice", type=int, default=10, help="nice increment of the adapting process (0: none)")
    p.add_argument("--worker-idle", action=argparse.BooleanOptionalAction, default=True,
                   help="the adapting process under SCHED_IDLE once started (Linux): it uses a core only when answering "
                        "leaves one idle")
    p.add_argument("--max-state-lag", type=float, default=120.0, help="readiness fails when queued work waited longer (s)")
    p.add_argument("--adapt-yield", type=int, default=2,
                   help="adaptation holds its batches while more searches than this are in flight (-1: never holds)")
    p.add_argument("--max-body-mb", type=float, default=8.0)
    p.add_argument("--max-pixels", type=int, default=4096 * 4096)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per answer (503 past it)")
    p.add_argument("--token-file", default=None, help="bearer token file (default: $HF_TTA_SERVICE_TOKEN)")
    p.add_argument("--search-needs-token", action="store_true")
    p.add_argument("--store", default=None, help="redis://host:port/db: publish/read the state through Redis")
    p.add_argument("--no-adapt", dest="adapt", action="store_false", help="answer only (the baseline, or a Redis replica)")
    p.add_argument("--no-access-log", dest="access_log", action="store_false", help="do not log every request")
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    """Parse ``argv`` and serve until stopped; a bad argument exits with status 2 and one line."""
    p = parser(prog)
    args = p.parse_args(argv)
    try:
        cfg = build_config(args)
    except (ValueError, TypeError, OSError) as err:
        p.exit(2, f"{p.prog}: error: {str(err).splitlines()[0]}\n")
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("hf_tta.service.access").setLevel(logging.INFO if args.access_log else logging.WARNING)
    uvicorn.run(create_app(cfg), host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=30)
