"""blink's HTTP layer: one transport in front of a Deployment, for any ASGI app (FastAPI or Starlette).

`HttpLayer(deployment, ServerSettings.from_env()).install(app)` puts it on an app before the app starts:

  routes   POST /v1/systemone, /v1/systemone/batch (laya-serve's: up to 64 states, one question set) and
           /v1/decisions, GET /v1/models (adapters/wire.py reads and shapes the protocols); GET /openapi.json (the
           /v1 routes' OpenAPI document, adapters/openapi.py); GET /metrics (Prometheus' text format). Each route
           checks the key and the body limit itself, so the routes are guarded wherever they are served.
  guard    ASGI middleware in front of every other route of that app (a Gradio app's included):
           - the body limit, BLINK_MAX_BODY_BYTES: a declared Content-Length past it is refused at once (413), a
             chunked body as it streams, before anything behind the guard reads it whole;
           - the key, BLINK_API_KEY: `Authorization: Bearer <key>`, compared in constant time, on whatever the
             host's KeyRule names (adapters/space.py: Gradio's API and MCP; the page itself stays open);
           - requests by route and status and their latency, for /metrics.

A /v1 request: key -> room (BLINK_CONCURRENCY answered at once in threads of the layer's own, BLINK_QUEUE_SIZE more
waiting, past that 503 with Retry-After) -> body (a declared length past the limit refused at once, then read and
counted as it arrives; zstd undone, never past the limit; multipart parts read) -> in a wire thread: parsed into a
WireCall, answered by the deployment's Batcher (packed with every other caller's requests), shaped -> the JSON reply.
A host plugs into that thread through a Handoff (adapters/space.py: ZeroGPU's quota token, ZeroGPU's refusals).

/metrics: blink_http_requests_total{route, status}, blink_http_request_duration_seconds{route},
blink_requests_waiting{stage, model} (for a wire thread, or for the model in its Batcher),
blink_http_requests_running, and, for every live forward of the deployment's Batchers (whoever asked: the page,
Gradio's API, MCP or /v1): blink_forward_requests{model} (requests packed into one forward),
blink_prompt_tokens_total{model, source} (computed by the model, or read from a kept or shared prefix) and
blink_model_seconds_total{model}.

The server's own settings are read here (ServerSettings), each BLINK_* variable once, as blink.Settings reads the
engine's. This module imports blink, adapters/wire and the ASGI stack (FastAPI, Starlette, anyio, prometheus_client);
never Gradio.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass

import anyio
from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from starlette.datastructures import Headers
from starlette.routing import Match

import blink
from adapters import openapi, wire

log = logging.getLogger("blink.http")
LOG_LINE_CHARS = 400  # the most of any one log line: nothing a caller sends is copied into the log past this
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
PACKING_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

# ==================================================================================================================
# Settings: what the server in front of a deployment is told
# ==================================================================================================================


@dataclass(frozen=True)
class ServerSettings:
    """The server's own settings, each BLINK_* variable once (blink.Settings holds the engine's). Build it with
    ServerSettings.from_env() (a server) or ServerSettings(field=...) (a test)."""

    concurrency: int = blink.setting("BLINK_CONCURRENCY", 16, 1)  # requests answered at once: Gradio's events, and
    # the wire threads beside them (the Batcher gathers what they hand it)
    queue_size: int = blink.setting("BLINK_QUEUE_SIZE", 64, 1)  # requests waiting past those, in Gradio's queue and
    # in the wire's line (ZeroGPU's Gradio default: 1)
    api_key: str | None = blink.setting("BLINK_API_KEY", None, secret=True)  # set: every programmatic surface needs
    # Authorization: Bearer <it>
    max_body_bytes: int = blink.setting("BLINK_MAX_BODY_BYTES", 64 * 1024 * 1024, 1024)  # any request's body, on the
    # wire and decompressed

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ServerSettings:
        """Server settings from the environment (default: os.environ), each variable checked and refused by name."""
        return cls(**blink.env_values(cls, os.environ if env is None else env))


# ==================================================================================================================
# What a host plugs in: a hand-off into the answering thread, and which of its own routes need the key
# ==================================================================================================================


class Handoff:
    """What a host adds around each /v1 answer; this one adds nothing. `carry` reads, in the event loop, what the
    answering thread needs from the HTTP request; `enter` puts it in place in that thread; `refusal` turns one of
    the host's own refusals into a WireError (any other error passes as it is)."""

    def carry(self, request: HTTPRequest) -> object:
        """What travels from the HTTP request to the thread that answers it (here: nothing)."""
        return None

    def enter(self, carried: object) -> None:
        """Put what `carry` read in place, in the answering thread (here: nothing to do)."""

    def refusal(self, exc: Exception) -> Exception:
        """A host's own refusal as a wire error (here: every error as it is)."""
        return exc


class KeyRule:
    """Which of the host's own routes (the ones the guard stands in front of) need the key; this one: none."""

    def needs_key(self, path: str, body: bytes | None) -> bool | None:
        """True or False for a request to `path` (relative to where the app is mounted); None when that depends on
        the body: the guard then reads the body (within the limit) and asks again with it."""
        return False


# ==================================================================================================================
# Body, key and log helpers shared by the routes and the guard
# ==================================================================================================================


class BodyCount:
    """One request body counted as it arrives: a declared Content-Length past the limit is refused at once, and so
    is the chunk that takes the count past it (413, wire.body_too_large)."""

    def __init__(self, headers: Mapping[str, str], limit: int):
        declared = headers.get("content-length", "")
        if declared.strip().isdigit() and int(declared) > limit:
            raise wire.body_too_large(limit)
        self.limit, self.seen = limit, 0

    def add(self, chunk: bytes) -> bytes:
        """The chunk, once counted; a WireError when it takes the body past the limit."""
        self.seen += len(chunk)
        if self.seen > self.limit:
            raise wire.body_too_large(self.limit)
        return chunk


def plain_refusal(exc: wire.WireError) -> Response:
    """A refusal outside the wire protocols (a host route, /metrics): {"detail": message} with the error's status,
    WWW-Authenticate on a 401 and Retry-After when retrying helps."""
    headers = {"www-authenticate": "Bearer"} if exc.status == 401 else {}
    if exc.retry_after is not None:
        headers["retry-after"] = f"{exc.retry_after:g}"
    return JSONResponse({"detail": str(exc)}, exc.status, headers)


def short(text: str, at_most: int = LOG_LINE_CHARS) -> str:
    """Text cut to at_most characters, saying how much was cut."""
    return text if len(text) <= at_most else f"{text[:at_most]}... ({len(text) - at_most} characters cut)"


class ShortRecords(logging.Filter):
    """Log records cut to LOG_LINE_CHARS a line, message and traceback alike: an error that quotes a caller's input
    never copies it into the log whole."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Shorten the record in place; keep it."""
        message = record.getMessage()
        if len(message) > LOG_LINE_CHARS:
            record.msg, record.args = short(message), ()
        if record.exc_info and not record.exc_text:
            trace = logging.Formatter().formatException(record.exc_info)
            record.exc_text = "\n".join(short(line) for line in trace.splitlines())
        return True


SHORT_RECORDS = ShortRecords()


def shorten_logs(*names: str) -> None:
    """ShortRecords on the named loggers (a filter on a logger is not consulted for its children's records)."""
    for name in names:
        logger = logging.getLogger(name)
        if SHORT_RECORDS not in logger.filters:
            logger.addFilter(SHORT_RECORDS)


def relative_path(scope: dict) -> str:
    """A request's path within the app that serves it (a mounted app's root_path taken off)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] or "/" if root and path.startswith(root) else path


# ==================================================================================================================
# Metrics
# ==================================================================================================================


class Waiting:
    """The gauges read when /metrics is: requests waiting for a wire thread and for the model (each Batcher's line),
    and wire requests being answered."""

    def __init__(self, threads: anyio.CapacityLimiter, deployment: blink.Deployment):
        self.threads, self.deployment = threads, deployment

    def collect(self):
        """The current values, as Prometheus metric families."""
        stats = self.threads.statistics()
        waiting = GaugeMetricFamily(
            "blink_requests_waiting",
            "Requests waiting: for a wire thread (stage http), or for the model in its Batcher (stage batcher)",
            labels=["stage", "model"],
        )
        waiting.add_metric(["http", ""], stats.tasks_waiting)
        for model, batcher in self.deployment.batchers().items():
            waiting.add_metric(["batcher", model], batcher.q.qsize())
        yield waiting
        yield GaugeMetricFamily(
            "blink_http_requests_running", "Wire requests being answered in wire threads", value=stats.borrowed_tokens
        )


@dataclass(frozen=True)
class ForwardFigures:
    """What one Batcher run's live forwards did: requests packed into each forward, prompt tokens computed and read
    from the prefix cache, model seconds (what /metrics and a Ray Serve replica's metrics count)."""

    packs: list[int]
    computed: int
    cached: int
    model_seconds: float


def forward_figures(results: list) -> ForwardFigures | None:
    """One Batcher run's figures (None: no live forward). Each Forward holds the tokens computed on its request's
    account (a prefix shared in the run counted once, on the first request that read it), so the run's computed
    tokens are their sum; a packed forward of k requests gives each of them the forward's model time, so each counts
    1/k of it and k of them make one forward. Answers from the answer cache computed nothing: their tokens count as
    cached, and they join no forward."""
    live = [r for r in results if isinstance(r, blink.Forward) and r.source == blink.LIVE]
    if not live:
        return None
    ran = [f for f in live if not f.recalled]
    packs = [
        size
        for size, count in collections.Counter(f.batched_requests or 1 for f in ran).items()
        for _ in range(-(-count // size))
    ]
    return ForwardFigures(
        packs=packs,
        computed=sum(f.prefill_tokens or 0 for f in live),
        cached=sum(f.cached_tokens or 0 for f in live),
        model_seconds=sum((f.model_ms or 0) / (f.batched_requests or 1) for f in ran) / 1000,
    )


class Metrics:
    """What /metrics serves, in a registry of the layer's own (two layers in one process never collide)."""

    def __init__(self, threads: anyio.CapacityLimiter, deployment: blink.Deployment):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "blink_http_requests", "HTTP requests, by route and status", ["route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "blink_http_request_duration_seconds",
            "Seconds from a request's arrival to the end of its reply, by route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.packing = Histogram(
            "blink_forward_requests",
            "Requests packed into one live forward of the model",
            ["model"],
            buckets=PACKING_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "blink_prompt_tokens",
            "Prompt tokens of live forwards: computed by the model (source computed) or read from a prefix kept by an "
            "earlier request or computed in the same run for another prompt (source cached)",
            ["model", "source"],
            registry=self.registry,
        )
        self.model_seconds = Counter(
            "blink_model_seconds", "Seconds the model spent in forward passes", ["model"], registry=self.registry
        )
        self.registry.register(Waiting(threads, deployment))

    def request(self, route: str, status: int, seconds: float) -> None:
        """One HTTP request, answered (or refused) with `status` after `seconds`."""
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def forwards(self, model: str, results: list) -> None:
        """One Batcher run (Deployment.watch): its live forwards, counted (forward_figures)."""
        figures = forward_figures(results)
        if figures is None:
            return
        for size in figures.packs:
            self.packing.labels(model).observe(size)
        self.tokens.labels(model, "computed").inc(figures.computed)
        self.tokens.labels(model, "cached").inc(figures.cached)
        self.model_seconds.labels(model).inc(figures.model_seconds)

    def exposition(self) -> bytes:
        """Every metric in Prometheus' text format."""
        return generate_latest(self.registry)


# ==================================================================================================================
# The layer: routes, admission, body, answer, reply
# ==================================================================================================================

OWN_PATHS = (
    "/v1/systemone",
    "/v1/systemone/batch",
    "/v1/decisions",
    "/v1/models",
    "/openapi.json",
    "/metrics",
)  # the routes guard themselves


class HttpLayer:
    """The transport of one deployment: its routes, its wire threads (BLINK_CONCURRENCY at once, never the threads
    a host's own events run on), its metrics, and the guard install() puts in front of a host's routes."""

    def __init__(self, deployment: blink.Deployment, settings: ServerSettings, handoff: Handoff | None = None):
        self.deployment, self.settings, self.handoff = deployment, settings, handoff or Handoff()
        self.threads = anyio.CapacityLimiter(settings.concurrency)
        self.metrics = Metrics(self.threads, deployment)
        deployment.watch(self.metrics.forwards)
        self.router = APIRouter()
        self.router.add_api_route("/v1/systemone", self.systemone, methods=["POST"])
        self.router.add_api_route("/v1/systemone/batch", self.systemone_batch, methods=["POST"])
        self.router.add_api_route("/v1/decisions", self.decisions, methods=["POST"])
        self.router.add_api_route("/v1/models", self.models, methods=["GET"])
        self.router.add_api_route("/openapi.json", self.openapi_page, methods=["GET"])
        self.router.add_api_route("/metrics", self.metrics_page, methods=["GET"])
        shorten_logs("blink", "blink.http", "blink.app")

    def install(self, app, rule: KeyRule | None = None) -> None:
        """Serve this layer on an ASGI app (FastAPI or Starlette) before it starts: its routes, and its guard in front
        of every route of the app, with the host's KeyRule (default: none of the host's routes need the key).
        Installing twice on one app does nothing."""
        if getattr(app.state, "blink_http", None) is self:
            return
        app.state.blink_http = self
        before = len(app.router.routes)
        if hasattr(app, "include_router"):
            app.include_router(self.router)
        else:
            app.router.routes.extend(self.router.routes)
        # first, so /openapi.json is this layer's document, not the one FastAPI (and Gradio's app) would serve there
        app.router.routes[:] = app.router.routes[before:] + app.router.routes[:before]
        app.add_middleware(Guard, layer=self, rule=rule or KeyRule())

    def check_key(self, headers: Mapping[str, str]) -> None:
        """The deployment's key, when it has one, or a 401 WireError (wire.check_bearer: constant time)."""
        wire.check_bearer(headers.get("authorization", ""), self.settings.api_key)

    def check_room(self) -> None:
        """Refuse a call at once (503, retry after a second) when every wire thread is busy and the waiting line is
        full."""
        stats, s = self.threads.statistics(), self.settings
        if stats.borrowed_tokens >= stats.total_tokens and stats.tasks_waiting >= s.queue_size:
            raise wire.WireError(
                f"busy: {s.concurrency} requests are running and {s.queue_size} waiting; retry shortly",
                [],
                503,
                "overloaded",
                retry_after=1,
            )

    async def read_body(self, request: HTTPRequest) -> tuple[object, dict[str, bytes]]:
        """The request body, refused past BLINK_MAX_BODY_BYTES before it is read whole (BodyCount), then decoded by
        wire.request_body; a multipart form's parts read here."""
        limit = self.settings.max_body_bytes
        count, raw = BodyCount(request.headers, limit), bytearray()
        async for chunk in request.stream():
            raw += count.add(chunk)
        data = wire.decoded_body(bytes(raw), request.headers.get("content-encoding", ""), limit)
        if wire.is_multipart(request.headers.get("content-type", "")):
            return await read_form(request, data, limit)
        return wire.request_body(data, request.headers.get("content-type", "")), {}

    def answer(self, protocol: wire.WireProtocol, body, parts: dict, carried: object) -> dict:
        """Parse, decide, shape; in a wire thread, with what the host carried in place (the Batcher runs a batch in
        its oldest caller's context)."""
        self.handoff.enter(carried)
        call = protocol.call(body, parts, self.deployment)
        return protocol.response(call, self.decided(call))

    def decided(self, call: wire.WireCall) -> dict:
        """{answers, meta} of a parsed call, answered by the model's Batcher. A host whose model answers elsewhere
        (replicas behind an ingress: adapters/serve.py) overrides this one step."""
        return self.deployment.submit(call.request, call.model)

    def answer_batch(self, protocol: wire.WireProtocol, body, parts: dict, carried: object) -> dict:
        """A batch call parsed, every state's request handed to the model's Batcher at once (so they share its
        forwards), and shaped; in a wire thread, like answer."""
        self.handoff.enter(carried)
        batch = wire.systemone_batch_call(body, parts, self.deployment)
        return wire.systemone_batch_response(batch, self.decided_many(batch))

    def decided_many(self, batch: wire.WireBatch) -> list:
        """{answers, meta} of each state's call, or the exception it raised, in order (Deployment.submit_many). A
        host that overrides decided overrides this too."""
        return self.deployment.submit_many([call.request for call in batch.calls], batch.model)

    def listing(self) -> dict:
        """GET /v1/models' payload: the deployment's models (a host whose models load elsewhere overrides it)."""
        return wire.models_listing(self.deployment)

    def reply(self, protocol: wire.WireProtocol, payload: dict | None, exc: Exception | None = None) -> Response:
        """The JSON reply of a wire route (wire.reply shapes it); a failure inside the model is logged here."""
        if exc is not None:
            exc = self.handoff.refusal(exc)
            if wire.wire_refusal(exc).kind == "server_error":
                log.error("wire request failed: %r", exc)
        status, headers, content = wire.reply(protocol, payload, exc)
        return Response(content, status, headers, media_type="application/json")

    async def wire_route(self, request: HTTPRequest, protocol: wire.WireProtocol, answer=None) -> Response:
        """One wire call: key, room, body; then parsed, answered and shaped in a wire thread (by `answer`, default
        self.answer)."""
        try:
            self.check_key(request.headers)
            self.check_room()
            body, parts = await self.read_body(request)
            payload = await anyio.to_thread.run_sync(
                answer or self.answer, protocol, body, parts, self.handoff.carry(request), limiter=self.threads
            )
        except Exception as exc:  # noqa: BLE001 - every failure becomes the protocol's error reply
            return self.reply(protocol, None, exc)
        return self.reply(protocol, payload)

    async def systemone(self, request: HTTPRequest) -> Response:
        """TypeSafe's System One API: {model, state, questions, assets?} -> {model, answers, usage}."""
        return await self.wire_route(request, wire.SYSTEM_ONE)

    async def systemone_batch(self, request: HTTPRequest) -> Response:
        """laya-serve's batch route: {model?, states: [...], questions, assets?} -> {results: [System One response per
        state]}, with /v1/systemone's key, limits and errors."""
        return await self.wire_route(request, wire.SYSTEM_ONE, self.answer_batch)

    async def decisions(self, request: HTTPRequest) -> Response:
        """OpenAI's Decisions API: {model, input, questions} -> {model, answers, usage}."""
        return await self.wire_route(request, wire.DECISIONS)

    async def models(self, request: HTTPRequest) -> Response:
        """The served models (and the default model's alias) as System One clients list them."""
        try:
            self.check_key(request.headers)
        except wire.WireError as exc:
            return self.reply(wire.SYSTEM_ONE, None, exc)
        return self.reply(wire.SYSTEM_ONE, self.listing())

    async def openapi_page(self, request: HTTPRequest) -> Response:
        """The OpenAPI 3.1 document of the /v1 routes (adapters/openapi.py), behind the key when there is one."""
        try:
            self.check_key(request.headers)
        except wire.WireError as exc:
            return self.reply(wire.SYSTEM_ONE, None, exc)
        return JSONResponse(openapi.document(self.deployment, self.settings.api_key is not None))

    async def metrics_page(self, request: HTTPRequest) -> Response:
        """Every metric in Prometheus' text format, behind the key when there is one."""
        try:
            self.check_key(request.headers)
        except wire.WireError as exc:
            return plain_refusal(exc)
        return Response(self.metrics.exposition(), 200, media_type=CONTENT_TYPE_LATEST)

    def route_name(self, scope: dict) -> str:
        """The route a request goes to, as /metrics labels it: the path template of the app's route that matches it
        (a mount's path for a mounted app), else "unmatched"; never the raw path, so the labels stay few."""
        app = scope.get("app")
        if app is None:
            return "unmatched"
        if getattr(app.state, "blink_routes", None) is None:
            app.state.blink_routes = list(flat_routes(app.router.routes))
        for route in app.state.blink_routes:
            if route.matches(scope)[0] is Match.FULL:
                return route.path
        return "unmatched"


def flat_routes(routes: list) -> Iterator:
    """Every route of an app, the routes of its included routers in their place (FastAPI keeps an included router
    as one route of its own, which matches without naming the route that will answer)."""
    for route in routes:
        included = getattr(getattr(route, "original_router", None), "routes", None)
        if included is not None:
            yield from flat_routes(included)
        elif getattr(route, "path", None) is not None:
            yield route


async def read_form(request: HTTPRequest, data: bytes, limit: int) -> tuple[object, dict[str, bytes]]:
    """A multipart body as typesafe-sdk sends images: the JSON `request` part, and every other part's bytes."""
    try:
        form = await HTTPRequest(request.scope, replayed(data, request.receive)).form(
            max_files=64, max_fields=64, max_part_size=limit
        )
    except Exception as exc:  # noqa: BLE001 - any malformed form is the caller's
        raise wire.WireError(
            f"the multipart body cannot be read: {getattr(exc, 'detail', exc)}", ["body"], 400, "invalid_request"
        ) from None
    parts = {name: await v.read() if hasattr(v, "read") else v.encode() for name, v in form.multi_items()}
    return wire.form_body(parts)


# ==================================================================================================================
# The guard: body limit, key and request metrics in front of every route of the app
# ==================================================================================================================

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class Guard:
    """ASGI middleware (HttpLayer.install adds it): times every HTTP request for /metrics; in front of the host's
    routes (the layer's own guard themselves) refuses a body past the limit as it arrives and asks for the key
    where the host's KeyRule says so, before anything behind it reads the body."""

    def __init__(self, app, layer: HttpLayer, rule: KeyRule):
        self.app, self.layer, self.rule = app, layer, rule

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, route, status = time.perf_counter(), self.layer.route_name(scope), [500]

        async def send_seen(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if relative_path(scope) in OWN_PATHS:
                await self.app(scope, receive, send_seen)
            else:
                await self.guarded(scope, receive, send_seen)
        finally:
            self.layer.metrics.request(route, status[0], time.perf_counter() - started)

    async def guarded(self, scope: dict, receive: Receive, send: Send) -> None:
        """A host route's request: refused at once for a declared body past the limit or a missing key, else passed
        on with its body counted as it arrives (and refused, 413, at the chunk that takes it past the limit)."""
        headers = Headers(scope=scope)
        try:
            count = BodyCount(headers, self.layer.settings.max_body_bytes)
            receive = await self.check_key(scope, headers, receive, count)
        except wire.WireError as exc:
            await plain_refusal(exc)(scope, receive, send)
            return
        refused: list[wire.WireError] = []
        replying = [False]

        async def counted() -> dict:
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                try:
                    count.add(message.get("body", b""))
                except wire.WireError as exc:
                    refused.append(exc)
                    return {
                        "type": "http.disconnect"
                    }  # what is behind stops reading: as far as it knows, the caller left
            return message

        async def send_unless_refused(message: dict) -> None:
            if refused:  # its reply to a body it never got whole: the refusal goes instead
                return
            replying[0] = replying[0] or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, send_unless_refused)
        except Exception:
            if not refused:
                raise
        if refused and not replying[0]:
            await plain_refusal(refused[0])(scope, receive, send)

    async def check_key(self, scope: dict, headers: Headers, receive: Receive, count: BodyCount) -> Receive:
        """The key, when there is one and the KeyRule asks for it (a rule that must see the body gets it, read within
        the limit); returns what reads the body from here on (the body read here, replayed)."""
        if self.layer.settings.api_key is None:
            return receive
        path = relative_path(scope)
        needs = self.rule.needs_key(path, None)
        if needs is None:
            body = bytearray()
            more = True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    break
                body += count.add(message.get("body", b""))
                more = message.get("more_body", False)
            needs = self.rule.needs_key(path, bytes(body))
            receive = replayed(bytes(body), receive)
            count.seen = 0  # counted once: the replayed body is counted again as it is read
        if needs:
            self.layer.check_key(headers)
        return receive


def replayed(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the body read already, then whatever the connection says next (a disconnect)."""
    sent = [False]

    async def again() -> dict:
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again
