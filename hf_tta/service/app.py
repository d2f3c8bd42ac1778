"""The HTTP app (FastAPI) around :class:`hf_tta.service.service.Service`.

Endpoints: ``POST /search`` (answer now; ``X-Tenant`` picks the tenant), ``POST /items`` and ``DELETE /items/{id}``
(token), ``GET /livez`` (the process answers), ``GET /readyz`` (503 with the reasons when the worker is dead or
silent, adaptation lags past its bound, or the state store is unreachable), ``GET /health`` (counters),
``GET /metrics`` (Prometheus), ``POST /admin/{pause,resume,reset,rollback,checkpoint}`` (token).

Every refusal is a 4xx whose body is ``{"detail": "<one line>"}``: request validation errors name the field and the
rule but never echo the input (a NaN or a megabyte caption cannot break or bloat the reply); bodies over the limit are
refused while they stream in (413); an answer that takes longer than ``Limits.timeout`` is a 503. Every request is
logged on ``hf_tta.service.access`` (method, path, status, milliseconds, tenant).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

from . import auth
from .limits import InputError
from .service import Service, ServiceConfig

access_log = logging.getLogger("hf_tta.service.access")


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    image: str | None = Field(None, description="base64 of an image file (PNG, JPEG, TIFF, ...)")
    text: str | None = None
    k: int = Field(10, ge=1, strict=True)


class ItemRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: int = Field(ge=0, le=2**53, strict=True)
    image: str | None = None
    text: str | None = None


class AdminRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: str | None = Field(None, max_length=64)


class ErrorBody(BaseModel):
    """The body of every refusal: one line, never the input."""

    detail: str = Field(description="what was wrong and how to fix it, in one line")


#: The responses the OpenAPI document gives every operation's refusals: the one-line :class:`ErrorBody` the service
#: sends (instead of FastAPI's list-shaped 422, which a schema-aware client would expect and never get).
ERRORS = {status: {"model": ErrorBody, "description": what} for status, what in (
    (400, "a bad input"), (401, "no or a wrong token"), (403, "refused (tenant limit, token)"), (404, "no such item"),
    (409, "conflicts with the gallery or the worker's state"), (413, "body, text or image over the limit"),
    (422, "a field breaks its rule"), (503, "not now: timeout, worker down, state folder not writable"))}


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` (413), by the declared length or, for a body without one (chunked),
    by counting its bytes as they stream in: the body is read up to the limit before the app sees it, so FastAPI's
    parser never turns the refusal into a 400. ``on_refuse(status)`` counts each refusal (the metrics)."""

    def __init__(self, app: Any, max_bytes: int, on_refuse: Callable[[str], None] | None = None):
        self.app, self.max_bytes, self.on_refuse = app, max_bytes, on_refuse

    async def _refuse(self, send: Any) -> None:
        if self.on_refuse is not None:
            self.on_refuse("413")
        await _reply(send, 413, f"request body over the limit of {self.max_bytes} bytes")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._refuse(send)
            return
        chunks, seen, last = [], 0, None
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: the app sees that as it arrived
                last = message
                break
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                await self._refuse(send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}] if last is None else [last]

        async def replayed() -> dict:
            return replay.pop(0) if replay else await receive()

        await self.app(scope, replayed, send)


async def _reply(send: Any, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _one_line(errors: list[dict]) -> str:
    """The first validation error as ``field: rule`` (never the input)."""
    if not errors:
        return "invalid request"
    err = errors[0]
    loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
    msg = str(err.get("msg", "invalid")).splitlines()[0]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{loc}: {msg}{more}"


def create_app(cfg: ServiceConfig):
    """The FastAPI app; the service starts with the app's lifespan and stops (saving its state) on shutdown."""
    from fastapi import FastAPI, Header, Path, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    service = Service(cfg)
    pool = ThreadPoolExecutor(cfg.answer_threads, thread_name_prefix="hf_tta-answer")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await asyncio.get_running_loop().run_in_executor(None, service.start)
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, service.stop)
            pool.shutdown(wait=False)

    app = FastAPI(title="hf_tta online retrieval", lifespan=lifespan)
    app.state.service = service
    app.add_middleware(BodyLimit, max_bytes=cfg.limits.max_body_bytes,
                       on_refuse=lambda status: service.metrics.refused.labels(status).inc())

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        service.metrics.refused.labels("422").inc()
        return JSONResponse({"detail": _one_line(list(exc.errors()))}, status_code=422)

    @app.exception_handler(InputError)
    async def refused(request: Request, exc: InputError):
        service.metrics.refused.labels(str(exc.status)).inc()
        return JSONResponse({"detail": str(exc).splitlines()[0]}, status_code=exc.status)

    @app.exception_handler(auth.AccessDenied)
    async def denied(request: Request, exc: auth.AccessDenied):
        service.metrics.refused.labels(str(exc.status)).inc()
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse({"detail": str(exc)}, status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if 400 <= exc.status_code < 500:  # a body that does not parse, an unknown route or method
            service.metrics.refused.labels(str(exc.status_code)).inc()
        return JSONResponse({"detail": str(exc.detail).splitlines()[0]}, status_code=exc.status_code)

    @app.middleware("http")
    async def log_and_count(request: Request, call_next):
        t0 = time.perf_counter()
        response = await call_next(request)
        elapsed = time.perf_counter() - t0
        route = request.scope.get("route")
        endpoint = getattr(route, "path", "unmatched")
        service.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        service.metrics.latency.labels(endpoint).observe(elapsed)
        access_log.info('%s %s %d %.1fms tenant=%s', request.method, request.url.path, response.status_code,
                        1000 * elapsed, request.headers.get("x-tenant", "-")[:64])
        return response

    async def run(fn, *args):
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(pool, fn, *args), cfg.limits.timeout)
        except asyncio.TimeoutError:
            raise InputError(f"the answer took longer than {cfg.limits.timeout:g} s: retry later", 503) from None

    @app.post("/search", responses=ERRORS)
    async def search(req: SearchRequest, x_tenant: str | None = Header(None), authorization: str | None = Header(None)) -> dict[str, Any]:
        if cfg.search_needs_token:
            auth.check(cfg.token, authorization, "search")
        return await run(service.search, req.image, req.text, req.k, x_tenant)

    @app.post("/items", status_code=201, responses=ERRORS)
    async def add_item(req: ItemRequest, authorization: str | None = Header(None)) -> dict[str, Any]:
        auth.check(cfg.token, authorization, "editing the gallery")
        return await run(service.add_item, req.id, req.image, req.text)

    @app.delete("/items/{item_id}", responses=ERRORS)
    async def delete_item(item_id: int = Path(ge=0, le=2**53), authorization: str | None = Header(None)) -> dict[str, Any]:
        auth.check(cfg.token, authorization, "editing the gallery")
        return await run(service.delete_item, item_id)

    @app.post("/admin/{op}", responses={**ERRORS, 202: {"description": "Accepted: queued behind the batch in flight, "
                                                                      "runs after it (the state version goes up then)"}})
    async def admin(op: str, req: AdminRequest | None = None, authorization: str | None = Header(None)) -> dict[str, Any]:
        auth.check(cfg.token, authorization, "the admin API")
        if op not in ("pause", "resume", "reset", "rollback", "checkpoint"):
            raise InputError("unknown admin operation: use pause, resume, reset, rollback or checkpoint", 404)
        tenant = req.tenant if req is not None else None
        result = await asyncio.get_running_loop().run_in_executor(None, service.admin, op, tenant)
        if result.get("accepted"):  # queued behind the batch in flight: 202, it runs after it
            return JSONResponse(result, status_code=202)
        return result

    @app.get("/livez")
    def livez() -> dict[str, Any]:
        return {"alive": True, "uptime_s": round(time.time() - service.started_at, 3)}

    @app.get("/readyz")
    def readyz():
        ready, body = service.readiness()
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return service.health()

    @app.get("/metrics")
    def metrics():
        service.metrics.collect_state(service)
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


__all__ = ["ERRORS", "ErrorBody", "create_app"]
