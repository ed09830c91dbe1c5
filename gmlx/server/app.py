"""The HTTP server: FastAPI app factory and routes (SPEC 6).

    POST /v1/systemone, POST /systemone   decisions (one handler)
    POST /v1/decisions                    the same decisions in OpenAI's shapes (SPEC 8)
    GET  /v1/models                       configured models and aliases (OpenAI and Jev shapes)
    GET  /health                          liveness, per-model state, request counters
    GET  /health/ready                    readiness for a load balancer (200 ready, 503 loading/draining)
    GET  /metrics                         Prometheus text format (gmlx.server.metrics)
    GET  /openapi.json                    FastAPI's schema

A decision is admitted on the event loop side (auth, body, parse, model
resolution, load, `admit`) and only then queued on its model's worker
(gmlx.server.worker); the handler waits for the result while watching for the
client to go away.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import hmac
import logging
import math
import signal
import threading
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from .. import __version__ as gmlx_version
from ..config import Config
from ..decisions.decide import admit
from ..errors import AuthenticationError, Cancelled, ClientClosed, GmlxError, InvalidRequest, ServerError, Timeout
from . import body as bodies
from . import schema as schemas
from .errors import EnvelopeMiddleware, error_response, id_headers, install
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import Metrics
from .models import ModelManager
from .routes import OpenAIDecisionsRoute, SystemOneRoute

log = logging.getLogger("gmlx.server")

# How often a handler whose decision waits in the queue looks whether it has
# started (its 504 deadline counts from then). A disconnect is seen at once.
QUEUED_POLL_S = 0.1
# A decision whose read overruns token_queue_timeout_s is answered 504 this long
# after the deadline even if the worker is still inside that read.
TIMEOUT_GRACE_S = 1.0


class Stats:
    """Request counters shown on /health (and handy for tests)."""

    def __init__(self) -> None:
        self.decisions = 0
        self.by_status: collections.Counter[str] = collections.Counter()
        self.content_encoding: collections.Counter[str] = collections.Counter()
        self.retried = 0  # requests a client marked as retries (X-TypeSafe-Retry-Count)
        self.disconnects = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "decisions": self.decisions,
            "by_status": dict(self.by_status),
            "content_encoding": dict(self.content_encoding),
            "retried": self.retried,
            "disconnects": self.disconnects,
        }


def _summary(body: dict) -> str:
    """Answers' top picks for the one log line per decision."""
    parts = []
    for qid, a in (body.get("answers") or {}).items():
        if a is None:
            parts.append(f"{qid}=skipped")
        elif a.get("type") == "noul":
            parts.append(f"{qid}={a['noul']:.3f}")
        elif a.get("type") == "choice":
            parts.append(f"{qid}={a['choice']}({a['confidence']:.2f})")
        elif a.get("type") == "score":
            parts.append(f"{qid}={a['score']:.2f}({a['confidence']:.2f})")
    return " ".join(parts)


# Admission of a decision under this size (state characters times questions:
# each question's largest prompt is rendered, and tokenized only when a byte
# bound of it may not fit the context) runs on the event loop: well under 1 ms
# for a three-question ticket, while handing it to a thread and back costs two
# thread wake-ups, about 0.3 ms on a small machine (docs/performance.md).
INLINE_ADMIT_CHARS = 16_000


def _small(decision) -> bool:
    if getattr(decision, "images", None):
        return False
    return (len(decision.state) + 512) * max(1, len(decision.questions)) <= INLINE_ADMIT_CHARS


_ROUTES = {"/v1/systemone", "/systemone", "/v1/decisions", "/v1/models", "/health", "/health/ready", "/metrics",
           "/openapi.json", "/docs", "/redoc"}


access_log = logging.getLogger("gmlx.access")


class RequestMetricsMiddleware:
    """Counts every HTTP response by route and status (pure ASGI: sees the
    final status, envelopes included), and writes the access log line:
    `client - "METHOD path HTTP/v" status`, like uvicorn's own, but once the
    response is sent (uvicorn's runs before it, on every request's path)."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        route = path if path in _ROUTES else "other"
        status = {"code": 0}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.request(route, status["code"] or 499)
            if status["code"] and access_log.isEnabledFor(logging.INFO):
                client = scope.get("client")
                query = scope.get("query_string") or b""
                access_log.info('%s - "%s %s%s HTTP/%s" %d', f"{client[0]}:{client[1]}" if client else "-",
                                scope.get("method"), path, "?" + query.decode("latin-1") if query else "",
                                scope.get("http_version"), status["code"])


async def _disconnected(receive) -> None:
    """Returns once the client has gone. Called after the whole body was read,
    so uvicorn's receive() blocks until the connection closes (or the response
    is complete, by which time nobody waits for this)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _trace(request: Request) -> str:
    """W3C trace context of the request, for following it through a proxy:
    " traceparent=... tracestate=..." (each only when sent; values cut to
    their spec's size and stripped of anything but printable ASCII)."""
    out = ""
    for name, limit in (("traceparent", 55), ("tracestate", 512)):
        value = request.headers.get(name)
        if value:
            clean = "".join(c for c in value[:limit] if 32 < ord(c) < 127)
            out += f" {name}={clean}"
    return out


def create_app(cfg: Config, preload: bool = False) -> FastAPI:
    from ..engine.media import configure as configure_media

    configure_media(cfg.server.media)  # limits for request images (engine/media.py)
    manager = ModelManager(cfg)
    metrics = Metrics(manager)
    manager.metrics = metrics
    stats = Stats()
    started = time.time()
    api_key = cfg.server.api_key
    # Models /health/ready waits for: server.preload, or every model with --preload.
    ready_models = list(cfg.models) if preload else list(cfg.server.preload)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.loop = asyncio.get_running_loop()
        if preload:
            await manager.preload()
        background = None
        if cfg.server.preload:
            manager.preloading = True
            background = asyncio.create_task(manager.preload_ids(list(cfg.server.preload)))
        yield
        if background is not None and not background.done():
            background.cancel()
        await manager.close()

    app = FastAPI(
        title="gmlx",
        version=gmlx_version,
        summary="Structured decisions from the logits of GGUF models (llama.cpp)",
        lifespan=lifespan,
    )
    app.state.manager = manager
    app.state.stats = stats
    app.state.metrics = metrics
    install(app)
    app.add_middleware(EnvelopeMiddleware)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)

    def check_auth(request: Request) -> None:
        if api_key is None:
            return  # no key configured: any bearer token, or none, is accepted
        header = request.headers.get("authorization") or ""
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthenticationError("missing API key: send Authorization: Bearer <key>")
        if not hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"), api_key.encode("utf-8")):
            raise AuthenticationError("invalid API key")

    async def read_body(request: Request) -> dict:
        limit = cfg.server.max_body_bytes
        bodies.check_content_type(request)
        codings = bodies.encodings_of(request.headers.get("content-encoding"))
        for c in codings or ["identity"]:
            stats.content_encoding["gzip" if c == "x-gzip" else c] += 1
        if codings:
            log.debug("request body Content-Encoding: %s", ", ".join(codings))
        raw = await bodies.read_raw(request, limit)
        data = bodies.decode(raw, codings, limit) if codings else raw
        return bodies.parse_json_object(data)

    async def wait_result(request: Request, worker, job) -> dict | None:
        """The decision's body, or None when the client went away. A task
        waits for the client's disconnect (uvicorn's `http.disconnect`: the
        body is read, nothing else can come), so nothing polls the connection
        while the decision runs; the loop only looks again at a queued
        decision (has it started?) and at the 504 deadline of a running one."""
        fut = asyncio.wrap_future(job.future)
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            while True:
                deadline = None if job.started is None else job.started + worker.timeout_s + TIMEOUT_GRACE_S
                wait_s = QUEUED_POLL_S if deadline is None else max(0.0, deadline - time.monotonic())
                done, _ = await asyncio.wait({fut, gone}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
                if fut in done:
                    return fut.result()
                if gone in done:
                    worker.cancel(job)
                    return None
                if deadline is not None and time.monotonic() > deadline:
                    worker.cancel(job)
                    raise worker.timeout_error()
        finally:
            if not gone.done():
                gone.cancel()
            # A receive that failed (a broken connection) counts as gone; nobody reads its error.
            gone.add_done_callback(lambda t: t.cancelled() or t.exception())
            if not fut.done():
                worker.cancel(job)
                # Nobody reads the outcome of an abandoned decision: consume it quietly.
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def serve_decision(request: Request, route) -> Response:
        """The one decision path of every decision route: `route` (a SystemOneRoute
        or an OpenAIDecisionsRoute) parses the body into a Decision, shapes the
        SPEC 4.8 result into its response, and may restate an error for its callers."""
        t0 = time.monotonic()
        slot = None
        model_id = None
        stats.decisions += 1
        if request.headers.get("x-typesafe-retry-count"):
            stats.retried += 1
        try:
            check_auth(request)
            payload = await read_body(request)
            decision = route.parse(payload, manager.settings)
            model_id = manager.resolve(decision.model)
            profile = manager.profile_for(model_id, decision.profile)
            slot = await manager.ready(model_id, profile)
            worker = slot.worker
            # The reader's check only renders and tokenizes prompts, which is
            # safe beside its worker. A small decision's check is cheaper than
            # the two thread wake-ups of handing it off; a long state, many
            # questions or images take a while: off the event loop.
            if _small(decision):
                admit(decision, worker.reader, manager.settings)
            else:
                await asyncio.to_thread(admit, decision, worker.reader, manager.settings)
            if decision.ignored:
                log.warning("ignoring unsupported parameter(s): %s", ", ".join(decision.ignored))
            job = worker.submit(decision)
            result = await wait_result(request, worker, job)
        except ClientDisconnect:
            stats.disconnects += 1
            log.info("client went away while sending its body")
            return error_response(InvalidRequest("the client closed the connection before sending the whole body"))
        except Cancelled:
            result = None
        except GmlxError as err:
            err = route.error(err)
            stats.by_status[str(err.status)] += 1
            metrics.rejection(model_id, err.status)
            if err.status >= 500 and not isinstance(err, Timeout):
                log.warning("decision failed (%d %s): %s", err.status, err.type, err.message)
            else:
                log.info("decision refused (%d %s): %s", err.status, err.type, err.message)
            return error_response(err)
        except Exception as err:  # noqa: BLE001 - e.g. a chat template that fails on this request
            stats.by_status["500"] += 1
            log.exception("decision failed unexpectedly")
            return error_response(ServerError(f"the decision failed: {type(err).__name__}: {err}"))
        if result is None:
            stats.disconnects += 1
            log.info("client went away: decision on %s cancelled after %.0f ms",
                     slot.name if slot else "?", (time.monotonic() - t0) * 1000)
            return error_response(ClientClosed("the client closed the connection; the decision was cancelled"))
        try:
            content = route.respond(result)
        except Exception as err:  # noqa: BLE001 - a response the route cannot shape is the server's fault
            stats.by_status["500"] += 1
            log.exception("decision %s could not be shaped for its route", result.get("id"))
            return error_response(ServerError(f"the decision failed: {type(err).__name__}: {err}"))
        stats.by_status["200"] += 1
        seconds = time.monotonic() - t0
        metrics.request_seconds.labels(model_id).observe(seconds)

        async def log_decision() -> None:
            # Written just after the response is sent (Starlette runs an async
            # background task right there, on this task): off the client's wait.
            try:
                timing = result["diagnostics"]["timing"]
                note = route.note()
                log.info(
                    "decision %s model=%s%s %s reads=%d ms=%.0f queue_ms=%.0f%s%s",
                    result["id"], model_id, f"@{profile}" if profile else "", _summary(result),
                    timing.get("reads", 0), seconds * 1000, timing.get("queue_ms", 0),
                    f" {note}" if note else "", _trace(request),
                )
            except Exception:  # noqa: BLE001 - the answer is sent; a log line never fails it
                log.exception("decision %s: its log line failed", result.get("id"))

        return _json_response(content, headers=id_headers(result["id"]), background=BackgroundTask(log_decision))

    async def systemone(request: Request) -> Response:
        return await serve_decision(request, SystemOneRoute())

    async def decisions(request: Request) -> Response:
        return await serve_decision(request, OpenAIDecisionsRoute())

    # The handlers read the raw body (limits, Content-Encoding, SPEC 5 errors):
    # their OpenAPI bodies are documented here, not inferred from a signature.
    systemone_doc = schemas.decision_route("SystemOneRequest", "SystemOneResponse")
    decisions_doc = schemas.decision_route("DecisionsRequest", "DecisionsResponse")
    app.add_api_route("/v1/systemone", systemone, methods=["POST"], summary="Answer a structured decision",
                      openapi_extra=systemone_doc)
    app.add_api_route("/systemone", systemone, methods=["POST"], summary="Answer a structured decision (alias)",
                      openapi_extra=systemone_doc)
    app.add_api_route("/v1/decisions", decisions, methods=["POST"],
                      summary="Answer a decision in the shapes of OpenAI's Decisions API", openapi_extra=decisions_doc)

    @app.get("/v1/models", summary="Configured models and aliases")
    async def list_models(request: Request) -> Response:
        check_auth(request)
        created = int(started)
        names: list[tuple[str, str]] = [(mid, mid) for mid in cfg.models]
        names += [(alias, target) for alias, target in cfg.aliases.items() if alias not in cfg.models]
        data, jev = [], []
        for name, target in names:
            data.append({"id": name, "object": "model", "created": created, "owned_by": "gmlx"})
            jev.append({
                "name": name,
                "description": _describe(cfg, manager, name, target),
                "release_date": _release_date(manager, target, started),
            })
        return JSONResponse({"object": "list", "data": data, "models": jev})

    @app.get("/health", summary="Liveness and per-model state")
    async def health() -> Response:
        fallback = cfg.fallback_id()
        return JSONResponse({
            "status": "shutting_down" if manager.stopping else "ok",
            "version": gmlx_version,
            "uptime_s": round(time.time() - started, 1),
            "fallback_model": fallback,
            "models": manager.health(),
            "requests": stats.as_dict(),
        })

    @app.get("/health/ready", summary="Readiness for a load balancer")
    async def health_ready() -> Response:
        ok, reason = manager.is_ready(ready_models)
        if ok:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": reason}, status_code=503, headers={"Retry-After": "2"})

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics_route(request: Request) -> Response:
        if cfg.server.metrics_auth:
            check_auth(request)
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    base_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        # FastAPI's schema plus the decision routes' body schemas (schema.py).
        if app.openapi_schema is None:
            doc = base_openapi()
            doc.setdefault("components", {}).setdefault("schemas", {}).update(
                schemas.components(manager.settings, sorted(cfg.profiles)))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_response(content: dict, headers: dict[str, str], background=None) -> JSONResponse:
    """JSON has no NaN or infinity: should a diagnostic carry one, it becomes null."""
    try:
        return JSONResponse(content, headers=headers, background=background)
    except ValueError:
        log.warning("response %s carried a non-finite number; sent as null", content.get("id"))
        return JSONResponse(_finite(content), headers=headers, background=background)


def _describe(cfg: Config, manager: ModelManager, name: str, target: str) -> str:
    slot = next((s for (m, _), s in manager.slots.items() if m == target and s.info), None)
    arch = f" ({slot.info.get('architecture')}, {slot.info.get('strategy') or 'no read strategy'})" if slot else ""
    if name != target:
        return f"alias of {target!r}: a GGUF model served by gmlx through llama.cpp{arch}"
    source = cfg.models[target].source
    short = source if source.startswith("package:") else source.rsplit("/", 1)[-1]
    return f"GGUF model {short} served by gmlx through llama.cpp{arch}"


def _release_date(manager: ModelManager, model_id: str, started: float) -> str:
    """The model file's modification date (YYYY-MM-DD), else the server's start date."""
    stamp = started
    path = manager.known_path(model_id)
    try:
        if path is not None:
            stamp = path.stat().st_mtime
    except OSError:
        pass
    return dt.datetime.fromtimestamp(stamp, dt.timezone.utc).strftime("%Y-%m-%d")




DRAIN_POLL_S = 0.05


def run(app: FastAPI, host: str, port: int, log_level: str = "info", grace_s: float | None = None) -> None:
    """Serve `app` with uvicorn. On SIGTERM/SIGINT the replica drains: new
    decisions get 503 with Retry-After (and /health/ready 503), the queued and
    running ones finish within `server.drain_grace_s`; then whatever is still
    queued gets 503, running ones are cancelled, and uvicorn stops (exit 0).
    A second signal stops at once."""
    import uvicorn

    manager: ModelManager = app.state.manager
    grace = manager.cfg.server.drain_grace_s if grace_s is None else grace_s

    class _Server(uvicorn.Server):
        draining = False

        def handle_exit(self, sig, frame) -> None:
            loop = getattr(app.state, "loop", None)
            if self.draining or loop is None or loop.is_closed():
                if loop is not None and not loop.is_closed():
                    loop.call_soon_threadsafe(manager.begin_shutdown)
                return super().handle_exit(sig, frame)
            self.draining = True
            # A signal handler must not take the workers' locks: hand it to the loop.
            loop.call_soon_threadsafe(lambda: loop.create_task(self._drain(sig, frame)))

        async def _drain(self, sig, frame) -> None:
            if grace <= 0:
                # No grace period: queued decisions get 503 at once, running ones finish.
                manager.begin_shutdown()
                return uvicorn.Server.handle_exit(self, sig, frame)
            manager.begin_drain()
            deadline = time.monotonic() + grace
            log.info("draining: new decisions get 503; waiting up to %.0f s for the queued ones", grace)
            while not manager.idle() and time.monotonic() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)
            if not manager.idle():
                log.warning("drain grace period (%.0f s) over: cancelling what is left", grace)
            manager.begin_shutdown()
            # Let the handlers of the last decisions write their responses.
            await asyncio.sleep(2 * QUEUED_POLL_S)
            uvicorn.Server.handle_exit(self, sig, frame)

    # access_log=False: RequestMetricsMiddleware writes the access line after the response.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=max(30, int(grace) + 10))
    server = _Server(config)
    if threading.current_thread() is not threading.main_thread():
        server.run()
        return
    # After its graceful shutdown uvicorn raises a captured SIGTERM again under
    # the handler installed before it started: with Python's default one the
    # process would then die by the signal (status -15) although it stopped
    # cleanly. A no-op handler there makes a graceful stop exit 0.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
