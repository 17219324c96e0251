"""The HTTP layer (adapters/http.py) and the Space around it (adapters/space.py) in real servers: with BLINK_API_KEY
set, the real gradio_client and a real MCP client are refused without the key and answered with it, while the page
itself (driven in chromium) stays open; a body past BLINK_MAX_BODY_BYTES sent to Gradio's routes is refused as it
arrives, the server's resident memory and its log staying flat; what Gradio would print of a caller's inputs stays out
of the log; /metrics counts what real requests did; `app.demo` mounted with gr.mount_gradio_app (and started by
Gradio's reload mode) is the whole app; where MCP cannot run the app says so in one line."""

from __future__ import annotations

import asyncio
import json
import os
import re
import select
import shutil
import socket
import threading
import time

import httpx
import psutil
import pytest
from conftest import ROOT, Gates, free_port, scrape_metrics, start_app, wait_until, wait_up
from fastapi import Request  # the plain app's route reads its annotation from this module
from prometheus_client.parser import text_string_to_metric_families

from bench.lib import servers

KEY = "http-test-key-4b1d9e"  # the keyed app's BLINK_API_KEY
AUTH = {"authorization": f"Bearer {KEY}"}
WRONG = {"authorization": "Bearer not-the-key"}
LIMIT = 1 << 20  # the keyed app's BLINK_MAX_BODY_BYTES
QS = {"late": {"type": "noul", "instructions": "Was the invoice paid late?"}}
DOCS = [
    "The invoice was due on 1 May and paid on 30 June, after two reminders.",
    "Payment arrived a week before the due date; the customer asked for a receipt.",
    "The March invoice is still open and the customer has stopped answering emails.",
    "A partial payment came on time; the rest followed three weeks later.",
    "The client paid on the due date by bank transfer.",
    "Two invoices were merged and paid together, one of them a month late.",
    "The payment bounced twice before it finally cleared in August.",
]
CHROMIUM = shutil.which("chromium")
VLLM_PYTHON = os.path.join(ROOT, ".venv-vllm", "bin", "python")


@pytest.fixture(scope="module")
def gates(tmp_path_factory) -> Gates:
    """Gates in front of admission and the model of the keyed app (open unless a test closes them)."""
    return Gates(str(tmp_path_factory.mktemp("http-gates")))


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, gates):
    """The app on the stand-in in its own process, with BLINK_API_KEY set, a 1 MiB body limit and `gates`; yields
    (url, log path, server process)."""
    env = {"BLINK_API_KEY": KEY, "BLINK_MAX_BODY_BYTES": str(LIMIT)}
    proc, url, log_path = start_app(env, str(tmp_path_factory.mktemp("keyed")), gates.prelude())
    try:
        wait_up(proc, url, log_path, 600)
        yield url, log_path, proc
    finally:
        servers.stop(proc)


def systemone(url: str, state: str, headers: dict | None = AUTH, questions: dict = QS) -> httpx.Response:
    """A System One request for `state`."""
    body = {"model": "jev-latest", "state": state, "questions": questions}
    return httpx.post(url + "v1/systemone", json=body, headers=headers, timeout=300)


def statuses(exc: BaseException | None, depth: int = 0) -> set[int]:
    """The HTTP statuses of every httpx.HTTPStatusError in an exception (group) and what caused it."""
    if exc is None or depth > 20:
        return set()
    if isinstance(getattr(exc, "exceptions", None), (list, tuple)):  # an exception group
        return set().union(*(statuses(e, depth + 1) for e in exc.exceptions))
    found = {exc.response.status_code} if isinstance(exc, httpx.HTTPStatusError) else set()
    return found | statuses(exc.__cause__ or exc.__context__, depth + 1)


async def mcp_work(url: str, headers: dict, work):
    """Run work(session) in an MCP session (the `mcp` package's streamable-HTTP client) sending `headers`."""
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async with httpx.AsyncClient(headers=headers, timeout=300) as http_client:
        async with streamable_http_client(url.rstrip("/") + "/gradio_api/mcp/", http_client=http_client) as (
            read,
            write,
            _,
        ):
            async with ClientSession(read, write) as session:
                await session.initialize()
                return await work(session)


async def list_and_decide(session):
    """The tools an MCP server lists, and its decide tool's result for one request."""
    tools = [t.name for t in (await session.list_tools()).tools]
    return tools, await session.call_tool("decide", {"state": DOCS[0], "questions": QS})


# A document long enough that its evidence is kept as a prefix (BLINK_PREFIX_MIN_TOKENS, 256 by default)
LEDGER = " ".join(
    f"On day {d} the warehouse shipped {d * 7} parcels and {d % 5} came back damaged." for d in range(1, 25)
)
AUDIT = " ".join(f"Invoice {n} for {n * 13} euros was paid {n % 4} days late by client {n % 9}." for n in range(1, 25))
PREDICATES = ["Were any parcels damaged?", "Is the tone neutral?", "Is money mentioned?", "Is a date mentioned?"]


def decisions(url: str, model: str, document: str, first: int) -> httpx.Response:
    """A Decisions request over `document`: four yes/no questions, rotated to start at PREDICATES[first]."""
    asked = PREDICATES[first:] + PREDICATES[:first]
    body = {"model": model, "input": document, "questions": [{"type": "predicate", "instructions": q} for q in asked]}
    return httpx.post(url + "v1/decisions", json=body, headers=AUTH, timeout=300)


def billed(reply: dict) -> int:
    """Prompt tokens a Decisions reply says were computed for it: input_tokens - cached_tokens."""
    usage = reply["usage"]
    return usage["input_tokens"] - usage["input_tokens_details"]["cached_tokens"]


# ------------------------------------------------------------------------------------------------------------------
# The key: every programmatic surface needs it; the page does not
# ------------------------------------------------------------------------------------------------------------------


def test_gradio_client_is_refused_without_the_key_and_answered_with_it(keyed):
    from gradio_client import Client

    url, _, _ = keyed
    calls = [(("x", QS), "/decide"), (([{"state": "x", "questions": QS}],), "/decide_batch"), ((), "/info")]
    for headers in (None, WRONG):
        client = Client(url, verbose=False, headers=headers)  # the API's description stays as open as the page
        for args, api_name in calls:
            with pytest.raises(httpx.HTTPStatusError) as refused:
                client.predict(*args, api_name=api_name)
            assert refused.value.response.status_code == 401, api_name
    client = Client(url, verbose=False, headers=AUTH)
    got = client.predict(DOCS[1], QS, api_name="/decide")
    batch = client.predict([{"state": DOCS[1], "questions": QS}], api_name="/decide_batch")
    assert client.predict(api_name="/info")["default_model"] == got["meta"]["model"]
    # the same request over /v1 (same process, same engine) gives the same number
    wire = systemone(url, DOCS[1]).json()["answers"]["late"]["noul"]
    assert got["meta"]["engine"] == "torch" and abs(got["answers"]["late"]["noul"] - wire) < 1e-6
    assert abs(batch[0]["answers"]["late"]["noul"] - wire) < 1e-6
    # Gradio's curl-style route too: refused at the door without the key, queued with it
    body = {"data": [DOCS[1], json.dumps(QS), 1.0, "", "live", None]}
    refused = httpx.post(url + "gradio_api/call/decide", json=body, timeout=60)
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert "event_id" in httpx.post(url + "gradio_api/call/decide", json=body, headers=AUTH, timeout=60).json()


def test_mcp_is_refused_without_the_key_and_answered_with_it(keyed):
    url, _, _ = keyed
    for headers in ({}, WRONG):
        with pytest.raises(BaseException) as refused:  # the client raises its transport's errors as a group
            asyncio.run(mcp_work(url, headers, list_and_decide))
        assert 401 in statuses(refused.value), repr(refused.value)
    tools, result = asyncio.run(mcp_work(url, AUTH, list_and_decide))
    assert {"decide", "decide_batch", "info"} <= set(tools) and not result.isError
    got = json.loads(result.content[0].text)  # the tool's call ran through Gradio's queue with the caller's key
    wire = systemone(url, DOCS[0]).json()["answers"]["late"]["noul"]
    assert abs(got["answers"]["late"]["noul"] - wire) < 1e-6


def test_the_page_calls_are_open_and_the_api_calls_need_the_key(keyed):
    """What the rule tells apart, sent by hand: a queue join or a run call naming the page's own (private) event is
    taken without the key; the same routes naming an API function are refused."""
    url, _, _ = keyed
    deps = httpx.get(url + "config", timeout=60).json()["dependencies"]
    decide = next(d["id"] for d in deps if d.get("api_name") == "decide" and d["api_visibility"] == "public")
    private = [d for d in deps if d["api_visibility"] == "private" and d.get("backend_fn")]
    switch = next(d["id"] for d in private if len(d["inputs"]) == 1 and len(d["outputs"]) == 2)  # the type radio
    skip_queue = next(d for d in private if d.get("queue") is False)  # the slider's "moved" flag
    join = url + "gradio_api/queue/join"
    ask = {"data": ["x", json.dumps(QS), 1.0, "", "live", None], "session_hash": "rule-check"}
    assert httpx.post(join, json={**ask, "fn_index": decide}, timeout=60).status_code == 401
    assert httpx.post(join, json={**ask, "fn_index": decide}, headers=AUTH, timeout=60).status_code == 200
    page = {"data": ["noul"], "fn_index": switch, "session_hash": "rule-check"}
    assert httpx.post(join, json=page, timeout=60).status_code == 200
    run = url + f"gradio_api/run/{skip_queue.get('api_name') or 'predict'}"
    moved = httpx.post(run, json={"data": [], "fn_index": skip_queue["id"], "session_hash": "rule-check"}, timeout=60)
    assert moved.status_code == 200 and "data" in moved.json(), moved.text
    assert httpx.post(run, json={**ask, "fn_index": decide}, timeout=60).status_code == 401
    assert httpx.post(url + "gradio_api/run/decide", json={"data": ask["data"]}, timeout=60).status_code == 401
    for path in ("gradio_api/mcp/", "gradio_api/mcp/schema", "metrics", "v1/models"):
        assert httpx.get(url + path, timeout=60).status_code == 401, path


@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium on PATH (bash tools/setup.sh --tests installs it)")
def test_the_page_stays_open_in_a_browser(keyed):
    from playwright.sync_api import expect, sync_playwright

    url, _, _ = keyed
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1600})
            page.set_default_timeout(120_000)
            page.goto(url)
            expect(page.locator(".bk-deploy")).to_be_visible()  # the page's own CSS class, rendered
            page.locator("#evidence textarea").fill(DOCS[2])
            box = page.locator("#temperature input[type=number]")  # the slider's event skips the queue
            box.fill("2.5")
            box.press("Enter")
            page.locator("#decide").click()
            expect(page.locator("#meta .bk-live")).to_contain_text("the model ran on this input", timeout=300_000)
            expect(page.locator("#meta .bk-meta")).to_contain_text("T = 2.5 (request)")
        finally:
            browser.close()


# ------------------------------------------------------------------------------------------------------------------
# One body limit for every route; nothing a caller sends is copied into the log
# ------------------------------------------------------------------------------------------------------------------


def raw_post(url: str, path: str, headers: dict, chunks=(), timeout_s: float = 300) -> tuple[int | None, int]:
    """POST over a plain socket: the head, then the body chunk by chunk for as long as the server takes it, stopping
    once it answers; returns (the status of its answer, or None when the connection went before one could be read;
    body bytes sent)."""
    host, port = url.split("//")[1].rstrip("/").split(":")
    head = f"POST /{path} HTTP/1.1\r\nhost: {host}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sent, deadline = 0, time.monotonic() + timeout_s
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall((head + "\r\n").encode())
        pending, chunks = b"", iter(chunks)
        while time.monotonic() < deadline:
            pending = pending or next(chunks, b"")
            if not pending:
                break
            readable, writable, _ = select.select([sock], [sock], [], deadline - time.monotonic())
            if readable:
                break
            try:
                n = sock.send(pending)
            except OSError:  # the server closed the connection
                break
            sent, pending = sent + n, pending[n:]
        select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        try:
            first = sock.recv(4096).split(b"\r\n", 1)[0].decode()
        except OSError:
            return None, sent
    match = re.match(r"HTTP/1\.1 (\d{3})", first)
    return (int(match.group(1)) if match else None), sent


def counted(chunks):
    """Chunks in HTTP's chunked transfer coding."""
    for chunk in chunks:
        yield b"%x\r\n%s\r\n" % (len(chunk), chunk)


def filler(total: int, head: bytes = b"", size: int = 1 << 16):
    """`head`, then filler up to `total` bytes, `size` at a time, never held whole."""
    yield head
    block = b"x" * size
    for _ in range(total // size):
        yield block


FILE_PART = (  # the start of an upload's one file part: what follows is the file's bytes
    b'--b\r\ncontent-disposition: form-data; name="files"; filename="big.bin"\r\n'
    b"content-type: application/octet-stream\r\n\r\n"
)


def scrape(url: str) -> dict[tuple, float]:
    """The keyed app's /metrics, parsed: {(sample name, (label, value) pairs sorted): value}."""
    return scrape_metrics(url, AUTH)


def delta(before: dict, after: dict, name: str, **labels) -> float:
    """How much one sample grew between two scrapes."""
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_a_body_over_the_limit_is_refused_as_it_arrives_on_gradio_routes(keyed):
    url, log_path, proc = keyed
    server = psutil.Process(proc.pid)  # `python -c "... import app; app.launch(...)"` itself
    huge = 300_000_000
    before, rss, logged = scrape(url), server.memory_info().rss, os.path.getsize(log_path)
    # a declared length past the limit: refused before any of it is read
    json_head = {"content-type": "application/json", **AUTH}
    assert raw_post(url, "gradio_api/call/decide", {**json_head, "content-length": str(huge)}) == (413, 0)
    # no length: counted as it streams, refused at the limit (on the queue, on an upload, on a call by name)
    outcomes = {}
    for path, headers, head in (
        ("gradio_api/queue/join", json_head, b'{"data": ["'),
        ("gradio_api/upload", {"content-type": "multipart/form-data; boundary=b"}, FILE_PART),
        ("gradio_api/call/decide", json_head, b'{"data": ["'),
    ):
        chunked = counted(filler(huge, head))
        outcomes[path] = raw_post(url, path, {**headers, "transfer-encoding": "chunked"}, chunked)
    after = scrape(url)
    grown_mb = (server.memory_info().rss - rss) / 2**20
    print(f"\nbody limit: {outcomes}; resident memory {grown_mb:+.1f} MB")
    for path, (status, sent) in outcomes.items():
        assert status in (413, None) and sent < huge / 10, (path, status, sent)  # stopped long before the end
    # the server said 413 to each (a reply the client may not read when the server closes a connection it stopped
    # reading); /metrics names each route by its template
    assert delta(before, after, "blink_http_requests_total", route="/gradio_api/call/{api_name}", status="413") == 2
    for route in ("/gradio_api/queue/join", "/gradio_api/upload"):
        assert delta(before, after, "blink_http_requests_total", route=route, status="413") == 1, route
    assert grown_mb < 64  # one 300 MB body read whole took the server from 386 MB to 1.04 GB
    grown_log = open(log_path, errors="replace").read()[logged:]
    assert len(grown_log) < 2000 and "x" * 100 not in grown_log, grown_log[:500]


def test_what_gradio_would_print_of_the_inputs_stays_out_of_the_log(keyed):
    """One input where decide takes six: Gradio raises an error quoting every input it received and prints it to the
    server's log; the Space's check says how many it got instead."""
    url, log_path, _ = keyed
    logged = os.path.getsize(log_path)
    body = {"data": ["x" * 200_000]}  # under the 1 MiB limit, so it reaches Gradio
    event = httpx.post(url + "gradio_api/call/decide", json=body, headers=AUTH, timeout=60).json()["event_id"]
    with httpx.stream("GET", url + f"gradio_api/call/decide/{event}", headers=AUTH, timeout=300) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("event:")]
    assert events == ["event: error"], events
    grown = open(log_path, errors="replace").read()[logged:]
    assert "didn't receive enough input values (needed: 6, got: 1)" in grown, grown[-2000:]
    assert "x" * 100 not in grown and len(grown) < 20_000, len(grown)


# ------------------------------------------------------------------------------------------------------------------
# /metrics: what the requests did
# ------------------------------------------------------------------------------------------------------------------


def test_metrics_count_what_the_requests_did(keyed, gates):
    url, _, _ = keyed
    before = scrape(url)
    alone = [systemone(url, doc) for doc in DOCS[:3]]  # one after another: each its own forward
    assert all(r.status_code == 200 for r in alone)
    assert systemone(url, "x", questions={"q": {"type": "score", "criteria": ["one"]}}).status_code == 422
    assert systemone(url, "x", headers=None).status_code == 401
    after = scrape(url)
    metas = [r.json()["x_meta"] for r in alone]
    assert all(m["batched_requests"] == 1 for m in metas)
    route = {"route": "/v1/systemone"}
    assert [delta(before, after, "blink_http_requests_total", **route, status=s) for s in ("200", "422", "401")] == [
        3,
        1,
        1,
    ]
    assert delta(before, after, "blink_http_request_duration_seconds_count", **route) == 5
    model = {"model": metas[0]["model"]}
    assert delta(before, after, "blink_forward_requests_count", **model) == 3
    assert delta(before, after, "blink_forward_requests_sum", **model) == 3
    assert delta(before, after, "blink_prompt_tokens_total", **model, source="computed") == sum(
        m["prefill_tokens"] for m in metas
    )
    assert delta(before, after, "blink_prompt_tokens_total", **model, source="cached") == sum(
        m["cached_tokens"] for m in metas
    )
    seconds = delta(before, after, "blink_model_seconds_total", **model)
    assert seconds == pytest.approx(sum(m["model_ms"] for m in metas) / 1000, rel=1e-9)

    # packed: the model held on one request while three more wait in its Batcher, then run as one forward
    before = after
    replies: dict = {}

    def ask(i: int) -> None:
        replies[i] = systemone(url, DOCS[3 + i])

    first = threading.Thread(target=ask, args=(0,))
    rest = [threading.Thread(target=ask, args=(i,)) for i in (1, 2, 3)]
    with gates.closed("forward"):
        first.start()
        assert wait_until(lambda: gates.arrived("forward") == 1, 300)
        for t in rest:
            t.start()
        waiting = {"stage": "batcher", **model}
        assert wait_until(lambda: scrape(url).get(("blink_requests_waiting", tuple(sorted(waiting.items())))) == 3)
        assert scrape(url)[("blink_http_requests_running", ())] == 4  # four wire requests in their threads
    for t in [first, *rest]:
        t.join(300)
    after = scrape(url)
    metas = [replies[i].json()["x_meta"] for i in range(4)]
    assert sorted(m["batched_requests"] for m in metas) == [1, 3, 3, 3]
    assert delta(before, after, "blink_forward_requests_count", **model) == 2
    assert delta(before, after, "blink_forward_requests_sum", **model) == 4
    assert delta(before, after, "blink_forward_requests_bucket", **model, le="1.0") == 1
    assert delta(before, after, "blink_forward_requests_bucket", **model, le="4.0") == 2
    # each request is billed what was computed on its account: over the four, input - cached is the computed count
    computed = sum(m["input_tokens"] - m["cached_tokens"] for m in metas)
    assert computed == sum(m["prefill_tokens"] for m in metas)
    assert delta(before, after, "blink_prompt_tokens_total", **model, source="computed") == computed
    assert after[("blink_requests_waiting", tuple(sorted(waiting.items())))] == 0

    # Gradio's routes are counted as well, by their route, refusals included
    from gradio_client import Client

    before = after
    Client(url, verbose=False, headers=AUTH).predict(DOCS[0], QS, api_name="/decide")
    with pytest.raises(httpx.HTTPStatusError):
        Client(url, verbose=False).predict(DOCS[0], QS, api_name="/decide")
    after = scrape(url)
    join = {"route": "/gradio_api/queue/join"}
    assert [delta(before, after, "blink_http_requests_total", **join, status=s) for s in ("200", "401")] == [1, 1]
    assert delta(before, after, "blink_forward_requests_count", **model) == 1  # the API shares the Batcher


def test_usage_adds_up_to_the_prompt_tokens_the_model_computed(keyed, gates):
    # Four concurrent requests over one new document and two over another, packed into one Batcher run, then a
    # repeat of one: each document's evidence is computed once, billed to the first request that reads it and cached for
    # every other question and request, so the bills add up to /metrics' computed count exactly.
    url, _, _ = keyed
    model = systemone(url, DOCS[6]).json()["x_meta"]["model"]
    before = scrape(url)
    replies: dict = {}

    def ask(name: str, document: str, first: int) -> None:
        replies[name] = decisions(url, model, document, first)

    blocker = threading.Thread(target=ask, args=("blocker", DOCS[5], 0))
    mates = [threading.Thread(target=ask, args=(f"ledger{i}", LEDGER, i)) for i in range(4)]
    mates += [threading.Thread(target=ask, args=(f"audit{i}", AUDIT, i)) for i in range(2)]
    with gates.closed("forward"):
        blocker.start()
        assert wait_until(lambda: gates.arrived("forward") == 1, 300)
        for t in mates:
            t.start()
        waiting = (("model", model), ("stage", "batcher"))
        assert wait_until(lambda: scrape(url).get(("blink_requests_waiting", waiting)) == 6, 300)
    for t in [blocker, *mates]:
        t.join(300)
    replies["repeat"] = decisions(url, model, LEDGER, 0)  # the ledger's evidence read from the prefix store
    after = scrape(url)
    assert all(r.status_code == 200 for r in replies.values()), {k: r.text for k, r in replies.items()}
    got = {name: r.json() for name, r in replies.items()}
    assert [got[f"ledger{i}"]["x_meta"]["batched_requests"] for i in range(4)] == [6] * 4
    computed = delta(before, after, "blink_prompt_tokens_total", model=model, source="computed")
    assert sum(billed(r) for r in got.values()) == computed > 0
    cached = delta(before, after, "blink_prompt_tokens_total", model=model, source="cached")
    assert sum(r["usage"]["input_tokens_details"]["cached_tokens"] for r in got.values()) == cached
    for name, asked in (("ledger", 4), ("audit", 2)):
        # the same four questions in each request: one paid for the document and its tails, its run-mates for the
        # same tails alone
        bills = sorted(billed(got[f"{name}{i}"]) for i in range(asked))
        assert len(set(bills[:-1])) == 1 and bills[-1] - bills[0] >= 256  # the evidence, over the kept minimum
        if name == "ledger":  # the repeat computed only its tails (the tests' apps keep no answers)
            assert billed(got["repeat"]) == bills[0] and got["repeat"]["x_meta"]["answer_cache"] is False


def test_the_layer_serves_any_asgi_app():
    """The layer on a plain FastAPI app of its own (as a Ray Serve ingress would mount it): its routes behind the
    key, the body limit in front of the app's own route, its metrics."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    import blink
    from adapters.http import HttpLayer, ServerSettings

    deployment = blink.Deployment(blink.Settings(engine="mock"))
    api = FastAPI()

    @api.post("/echo")
    async def echo(request: Request) -> dict:
        return {"read": len(await request.body())}

    HttpLayer(deployment, ServerSettings(api_key=KEY, max_body_bytes=4096)).install(api)
    body = {"model": "jev-latest", "state": DOCS[0], "questions": QS}
    with TestClient(api) as client:
        assert client.post("/v1/systemone", json=body).status_code == 401
        answered = client.post("/v1/systemone", json=body, headers=AUTH).json()
        want = deployment.decide(DOCS[0], QS)["answers"]["late"]["noul"]
        assert answered["answers"]["late"]["noul"] == want
        assert client.post("/echo", content=b"x" * 100).json() == {"read": 100}
        assert client.post("/echo", content=b"x" * 5000).status_code == 413  # declared
        assert client.post("/echo", content=iter([b"x" * 3000] * 2)).status_code == 413  # chunked, at the limit
        assert client.get("/metrics").status_code == 401
        metrics = {
            (s.labels.get("route"), s.labels.get("status")): s.value
            for family in text_string_to_metric_families(client.get("/metrics", headers=AUTH).text)
            for s in family.samples
            if s.name == "blink_http_requests_total"
        }
    assert metrics[("/v1/systemone", "401")] == metrics[("/v1/systemone", "200")] == 1
    assert metrics[("/echo", "200")] == 1 and metrics[("/echo", "413")] == 2 and metrics[("/metrics", "401")] == 1


# ------------------------------------------------------------------------------------------------------------------
# `app.demo` is the whole app however it is started; MCP where it cannot run
# ------------------------------------------------------------------------------------------------------------------

MOUNTED = """
import gradio as gr, uvicorn
from fastapi import FastAPI
import app
server = FastAPI()
gr.mount_gradio_app(server, app.demo, path="/blink")
uvicorn.run(server, host="127.0.0.1", port={port}, log_level="warning")
"""


def check_whole_app(url: str) -> None:
    """The app at `url` serves the page with its CSS and theme, /v1 and /metrics behind the key, and MCP tools whose
    results are JSON."""
    config = httpx.get(url + "config", timeout=60).json()
    assert ".bk-deploy" in config["css"] and config["theme"] == "soft"
    assert systemone(url, "x", headers=None).status_code == 401
    answered = systemone(url, DOCS[0])
    assert answered.status_code == 200 and answered.json()["x_meta"]["fabricated"] is True
    assert "blink_http_requests_total" in httpx.get(url + "metrics", headers=AUTH, timeout=60).text
    tools, result = asyncio.run(mcp_work(url, AUTH, list_and_decide))
    got = json.loads(result.content[0].text)  # JSON, not Python's repr
    assert "decide" in tools and got["answers"]["late"]["noul"] == answered.json()["answers"]["late"]["noul"]


@pytest.mark.parametrize("how", ["gr.mount_gradio_app", "gradio reload mode"])
def test_demo_is_the_whole_app_however_it_is_started(tmp_path, how):
    import subprocess
    import sys

    env = {"BLINK_MOCK": "1", "BLINK_API_KEY": KEY}
    if how == "gr.mount_gradio_app":
        port, log_path = free_port(), str(tmp_path / "mounted.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-c", MOUNTED.format(port=port)],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", **env},
            )
        url = f"http://127.0.0.1:{port}/blink/"
    else:  # `gradio app.py`: Gradio runs the file in reload mode, serving `demo`
        gradio_cli = os.path.join(os.path.dirname(sys.executable), "gradio")
        proc, url, log_path = start_app(env, tmp_dir=str(tmp_path), python=gradio_cli, as_script=True)
    try:
        wait_up(proc, url, log_path, 600)
        check_whole_app(url)
    finally:
        servers.stop(proc)


@pytest.mark.skipif(not os.path.exists(VLLM_PYTHON), reason="no vLLM environment (bash tools/setup.sh --vllm)")
def test_where_mcp_cannot_run_the_app_says_so_in_one_line(tmp_path):
    proc, url, log_path = start_app({"BLINK_MOCK": "1"}, tmp_dir=str(tmp_path), python=VLLM_PYTHON, as_script=True)
    try:
        wait_up(proc, url, log_path, 600)
        assert systemone(url, DOCS[0], headers=None).status_code == 200
        log = open(log_path).read()
    finally:
        servers.stop(proc)
    lines = [line for line in log.splitlines() if "MCP" in line]
    assert len(lines) == 1 and lines[0].startswith("blink: MCP is off: mcp 2"), log[-3000:]
    assert "/v1/systemone" in lines[0] and "call_tool" not in log
