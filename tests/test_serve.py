"""blink on Ray Serve (adapters/serve.py) on a real local cluster of two Ray nodes with one CPU each: the app scales
from one replica to two under load, answers through the ingress with typesafe-sdk and openai as in-process decide()
does, refuses as app.py's HTTP layer does, keeps each document on its home replica, and loses no request when a
replica is killed mid-burst. One cluster and one app for the module; every Ray process is gone after it."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import math
import os
import tempfile
import threading
import time

import httpx
import pytest
import ray
from conftest import ROOT
from fastapi import FastAPI
from fastapi.testclient import TestClient
from openai import AuthenticationError, OpenAI
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from typesafe_sdk import Choice, Noul, RetryPolicy, Score, TypeSafeAuthenticationError, TypeSafeClient

import blink
from adapters import http, wire
from adapters import serve as serve_app
from bench.lib import servers

KEY = "serve-test-key"
APP = "blink"
# What every process of the cluster gets: the exact float32 path, the key, evidence kept from 32 tokens (the test
# documents are short), and Serve's autoscaling metrics pushed every second (the scaling test waits on them).
CLUSTER_ENV = {
    "BLINK_DTYPE": "float32",
    "BLINK_API_KEY": KEY,
    "BLINK_PREFIX_MIN_TOKENS": "32",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
}
# One replica to start, two under load: Serve's autoscaling, told to react at once and never to scale back down here.
ARGS = {
    "min_replicas": 1,
    "max_replicas": 2,
    "autoscaling": {
        "target_ongoing_requests": 1,
        "upscale_delay_s": 0,
        "downscale_delay_s": 3600,
        "look_back_period_s": 11,  # over the default metrics interval (10 s)
    },
}
WORDS = (
    "the customer wrote again about a refund for the annual plan and asked whether the invoice could be split across "
    "two cost centres because the finance team closes its books on friday and the card on file expired last month"
).split()
QUESTIONS = (
    {"urgent": {"type": "noul", "instructions": "Does this need an answer today?"}},
    {
        "team": {
            "type": "choice",
            "instructions": "Which team takes it?",
            "criteria": {"billing": None, "access": None, "other": None},
        }
    },
    {"tone": {"type": "score", "instructions": "How upset is the customer?", "criteria": ["calm", "annoyed", "angry"]}},
)


def document(n: int, words: int = 60) -> str:
    """Test document n: a ticket of `words` words, distinct for every n."""
    return f"Ticket {n}. " + " ".join(WORDS[(n * 7 + i) % len(WORDS)] for i in range(words))


def systemone(state, questions: dict) -> dict:
    """A System One body for the default model."""
    return {"model": "jev-latest", "state": state, "questions": questions}


def post(url: str, body: dict, key: str = KEY, route: str = "/v1/systemone") -> httpx.Response:
    """One wire request with the key."""
    return httpx.post(url + route, json=body, headers={"authorization": f"Bearer {key}"}, timeout=300)


def info(url: str) -> dict:
    """The ingress's /info."""
    return httpx.get(url + "/info", headers={"authorization": f"Bearer {KEY}"}, timeout=60).json()


def live(url: str) -> list[str]:
    """The replicas the ingress's router routes to now."""
    return [r["replica"] for r in info(url)["replicas"] if r["live"]]


def poll(check, timeout_s: float, every_s: float = 0.25):
    """check() until it is truthy or the time is up (polling a server, so not every 20 ms); its last value."""
    deadline = time.monotonic() + timeout_s
    while not (value := check()) and time.monotonic() < deadline:
        time.sleep(every_s)
    return value


@pytest.fixture(scope="module")
def ray_root():
    """A new, empty temp root made Ray's (RAY_TMPDIR) for the module, as on a machine where Ray never ran: Ray's
    default temp folder (<root>/ray) is absent when the cluster starts. Nothing may be left in it afterwards."""
    root = tempfile.mkdtemp(prefix="r", dir="/tmp")  # short: Ray's socket paths go below it
    try:
        with servers.environment({"RAY_TMPDIR": root}):
            yield root
    finally:
        left = os.listdir(root)
        if not left:
            os.rmdir(root)
    assert left == [], f"the cluster left {left} in its temp root"


@pytest.fixture(scope="module")
def cluster(ray_root):
    """Two Ray nodes of one CPU each on this machine, Serve on them with the app (one replica to start): the bench's
    servers.ray_serve, which checks on leaving that every process of the cluster is gone; yields the app's URL."""
    assert not os.path.exists(os.path.join(ray_root, "ray"))  # Ray's default temp folder is not there
    with servers.ray_serve(CLUSTER_ENV, nodes=2, cpus=1) as url:
        serve.run(serve_app.app(ARGS), name=APP, route_prefix="/")
        yield url


def test_the_cluster_starts_where_ray_never_ran_and_keeps_its_files_in_a_folder_of_its_own(cluster, ray_root):
    """Started under a temp root without Ray's default folder, the cluster is up, and everything Ray wrote (the
    address file ray.cluster_utils writes to the default folder, the session with its sockets and logs) is inside
    the one folder the cluster made for itself, which is gone once it stops (ray_root's teardown checks that)."""
    (own,) = os.listdir(ray_root)
    assert own.startswith("blink-ray-")
    temp = os.path.join(ray_root, own)
    assert os.environ["RAY_TMPDIR"] == temp
    with open(os.path.join(temp, "ray", "ray_current_cluster")) as fh:
        assert fh.read() == ray.get_runtime_context().gcs_address
    assert os.path.realpath(ray._private.worker.global_worker.node.get_session_dir_path()).startswith(temp + os.sep)
    assert httpx.get(cluster + "/-/healthz", timeout=60).status_code == 200


def answer_of(response: httpx.Response) -> dict:
    """A 200 System One reply's body (the status and body named when it is not one)."""
    assert response.status_code == 200, (response.status_code, response.text[:500])
    return response.json()


@pytest.fixture(scope="module")
def scaled(cluster):
    """Load from four clients, each asking about new documents, until Serve has scaled the replicas from one to two
    and the second has answered; returns (the replicas live before the load, every (body, reply) of the load)."""
    url = cluster
    answer_of(post(url, systemone(document(0), QUESTIONS[0])))  # the router starts with the first request
    before = live(url)
    stop, outcomes, lock = threading.Event(), [], threading.Lock()

    def client(c: int) -> None:
        n = 0
        while not stop.is_set():
            body = systemone(document(1000 * (c + 1) + n), QUESTIONS[n % 3])
            reply = post(url, body)
            with lock:
                outcomes.append((body, reply))
            n += 1

    def replicas_answering() -> set:
        with lock:
            return {r.json()["x_meta"]["replica"] for _, r in outcomes if r.status_code == 200}

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        clients = [pool.submit(client, c) for c in range(4)]
        poll(lambda: len(replicas_answering()) == 2 or any(c.done() for c in clients), 300)
        stop.set()
    for c in clients:
        c.result()  # a client that failed says why
    return before, outcomes


def test_the_app_scales_from_one_replica_to_two_under_load_answering_every_request(cluster, scaled):
    before, outcomes = scaled
    assert len(before) == 1
    answered = [answer_of(reply) for _, reply in outcomes]
    assert {a["x_meta"]["replica"] for a in answered} == set(live(cluster)) and len(live(cluster)) == 2
    for (body, _), got in zip(outcomes, answered):
        assert set(got["answers"]) == set(body["questions"]) and got["model"] == blink.STANDIN_MODEL


STRUCTURED = {
    "urgent": Noul(instructions="Does this need an answer today?", criteria={"true": "they cannot pay at all"}),
    "team": Choice(
        instructions="Which team takes it?", criteria={"billing": "payments", "access": ["login", "SSO"], "other": None}
    ),
    "tone": Score(instructions="How upset is the customer?", criteria=["calm", {"when": "annoyed"}, "angry"]),
}


def test_answers_through_the_ingress_equal_in_process_decide(cluster, scaled, standin, served):
    here = served(standin)
    with TypeSafeClient(api_key=KEY, base_url=cluster, timeout=300, retry=RetryPolicy(max_retries=0)) as ts:
        r = ts.system_one(state=document(7, 120), questions=STRUCTURED)
        listed = ts.models.list()
    questions = {k: q.model_dump(exclude_none=True) for k, q in STRUCTURED.items()}
    want = here.decide(document(7, 120), questions)["answers"]
    assert r.model == blink.STANDIN_MODEL and r.raw_http_response.json()["x_meta"]["replica"] in live(cluster)
    assert abs(r.nouls["urgent"].noul - want["urgent"]["probabilities"]["yes"]) < 1e-5
    team = r.choices["team"]
    assert team.choice == want["team"]["choice"]
    assert all(abs(team.probabilities[k] - want["team"]["probabilities"][k]) < 1e-5 for k in team.probabilities)
    tone = r.scores["tone"]
    assert [tone.probabilities[i] for i in range(3)] == pytest.approx(
        [want["tone"]["probabilities"][str(i)] for i in range(3)], abs=1e-5
    )
    assert [m.name for m in listed.models] == [blink.STANDIN_MODEL, wire.DEFAULT_MODEL_ALIAS]
    assert all(len(m.release_date) == 10 for m in listed.models)  # the date of the weights on the replica

    decision = OpenAI(base_url=cluster + "/v1", api_key=KEY, max_retries=0, timeout=300).decisions.create(
        model=blink.STANDIN_MODEL,
        input=document(8, 120),
        questions=[
            {"type": "predicate", "name": "urgent", "instructions": "Does this need an answer today?"},
            {"type": "choice", "instructions": "Which team?", "choices": [{"value": "billing"}, {"value": "access"}]},
        ],
    )
    want = here.decide(
        document(8, 120),
        {
            "0": {"type": "noul", "instructions": "Does this need an answer today?"},
            "1": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "access": None}},
        },
    )["answers"]
    urgent, team = decision.answers
    assert abs(urgent.probability - want["0"]["probabilities"]["yes"]) < 1e-5
    assert [p.probability for p in team.probabilities] == pytest.approx(
        [want["1"]["probabilities"][k] for k in ("billing", "access")], abs=1e-5
    )


@pytest.fixture(scope="module")
def beside(standin):
    """app.py's HTTP layer over the stand-in on a plain FastAPI app in this process, keyed as the cluster is."""
    app = FastAPI()
    http.HttpLayer(blink.Deployment.serving(standin), http.ServerSettings(api_key=KEY)).install(app)
    with TestClient(app) as client:
        yield client


REFUSED = [
    ("/v1/systemone", {"model": "jev-latest", "questions": {"q": {"type": "noul"}}}, KEY),  # no state
    ("/v1/systemone", systemone("x", {"q": {"type": "choice", "criteria": ["one"]}}), KEY),  # one option
    ("/v1/systemone", {**systemone("x", QUESTIONS[0]), "model": "nobody/nothing"}, KEY),  # not served: 404
    ("/v1/systemone", systemone({"image": "ASSET"}, QUESTIONS[0]) | {"assets": {"ASSET": {}}}, KEY),  # text only
    ("/v1/decisions", {"model": "jev-latest", "input": "x", "questions": [{"type": "guess"}]}, KEY),
    ("/v1/decisions", {"model": "jev-latest", "input": "x", "questions": []}, KEY),
    ("/v1/systemone", systemone("x", QUESTIONS[0]), "wrong-key"),  # 401
    ("/v1/decisions", {"model": "jev-latest", "input": "x", "questions": []}, "wrong-key"),  # 401
]


@pytest.mark.parametrize("route, body, key", REFUSED)
def test_refusals_are_app_pys_byte_for_byte(cluster, scaled, beside, route, body, key):
    here, there = (
        beside.post(route, json=body, headers={"authorization": f"Bearer {key}"}),
        post(cluster, body, key, route),
    )
    assert there.status_code == here.status_code >= 400
    assert there.content == here.content
    for header in ("retry-after", "www-authenticate", "content-type"):
        assert there.headers.get(header) == here.headers.get(header)


def test_a_wrong_key_is_refused_by_both_clients_and_on_every_route(cluster, scaled):
    with pytest.raises(TypeSafeAuthenticationError):
        with TypeSafeClient(api_key="wrong", base_url=cluster, retry=RetryPolicy(max_retries=0)) as ts:
            ts.system_one(state="x", questions={"q": Noul(instructions="Is it?")})
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=cluster + "/v1", api_key="wrong", max_retries=0).decisions.create(
            model=blink.STANDIN_MODEL, input="x", questions=[{"type": "predicate", "instructions": "Is it?"}]
        )
    for route in ("/info", "/metrics", "/v1/models"):
        refused = httpx.get(cluster + route, headers={"authorization": "Bearer wrong"})
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer", route
        assert httpx.get(cluster + route, headers={"authorization": f"Bearer {KEY}"}).status_code == 200, route


def homed(url: str, count: int, start: int) -> dict[str, list[int]]:
    """`count` test documents homed on each live replica (by the evidence key's rendezvous ranking), from `start`."""
    replicas, homes, n = live(url), {}, start
    while any(len(homes.get(r, [])) < count for r in replicas):
        request = blink.parse_request(document(n), QUESTIONS[0])
        home = serve_app.ranked(serve_app.evidence_key(blink.STANDIN_MODEL, request), replicas)[0]
        if len(homes.setdefault(home, [])) < count:
            homes[home].append(n)
        n += 1
    return homes


def test_evidence_routing_keeps_each_document_on_one_home_replica(cluster, scaled):
    homes = homed(cluster, 2, 5000)
    asks = [(doc, q) for q in range(3) for docs in zip(*homes.values()) for doc in docs]  # interleaved documents
    # three clients: never near the queued tokens that give a document a second home (BLINK_ROUTE_HOT_LEAD)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda a: answer_of(post(cluster, systemone(document(a[0]), QUESTIONS[a[1]]))), asks))
    answered_by: dict[int, set] = {}
    for (doc, _), reply in zip(asks, replies):
        answered_by.setdefault(doc, set()).add(reply["x_meta"]["replica"])
    assert all(len(replicas) == 1 for replicas in answered_by.values()), answered_by  # one home each
    used = {r for rs in answered_by.values() for r in rs}
    assert len(used) == 2  # distinct documents use both replicas
    last = [r for (_, q), r in zip(asks, replies) if q == 2]  # each document's third ask finds its evidence kept
    assert all(r["x_meta"]["cached_tokens"] > 0 for r in last)
    rows = {r["replica"]: r for r in info(cluster)["replicas"] if r["live"]}
    assert all(rows[replica]["hit_rate"] > 0 for replica in used)


def test_killing_a_replica_mid_burst_loses_no_request(cluster, scaled):
    homes = homed(cluster, 8, 9000)
    victim, survivor = list(homes)
    actor = ray.get_actor(f"SERVE_REPLICA::{APP}#Replica#{victim}", namespace="serve")
    # 24 requests over documents homed on the victim: seconds of its work, so some are in flight when it is killed
    bodies = [systemone(document(n, 300), q) for n in homes[victim] for q in QUESTIONS]
    retried = info(cluster)["retried"]

    def in_flight() -> int:
        return next((r["in_flight"] for r in info(cluster)["replicas"] if r["replica"] == victim), 0)

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        replies = [pool.submit(post, cluster, body) for body in bodies]
        assert poll(lambda: in_flight() >= 2, 120, every_s=0.05)
        ray.kill(actor, no_restart=False)
        answered = [answer_of(reply.result()) for reply in replies]
    assert len(answered) == len(bodies)  # every request answered, once each (one reply per call)
    for body, got in zip(bodies, answered):
        assert set(got["answers"]) == set(body["questions"])
    assert survivor in {a["x_meta"]["replica"] for a in answered}  # the killed replica's share moved
    assert info(cluster)["retried"] > retried
    assert poll(lambda: len(live(cluster)) == 2 and victim not in live(cluster), 300)  # Serve replaced it


def scraped(address: str, port: int) -> dict[str, list]:
    """A node's metrics export (Ray's, where the cluster's Prometheus scrapes), its blink families by name."""
    text = httpx.get(f"http://{address}:{port}/metrics", timeout=30).text
    return {f.name: f.samples for f in text_string_to_metric_families(text) if "blink_replica" in f.name}


def test_a_replicas_forward_metrics_reach_rays_metrics_export(cluster, scaled):
    reply = answer_of(post(cluster, systemone(document(7000), QUESTIONS[1])))
    replica = reply["x_meta"]["replica"]
    node = next(r["node"] for r in info(cluster)["replicas"] if r["replica"] == replica)
    where = next(n for n in ray.nodes() if n["NodeID"] == node and n["Alive"])  # the node's export port, as Ray says

    def mine() -> dict[str, list]:
        families = scraped(where["NodeManagerAddress"], where["MetricsExportPort"])
        return {
            name: [s for s in samples if s.labels.get("replica") == replica and s.labels.get("node") == node]
            for name, samples in families.items()
        }

    def billed() -> int:
        """The prompt tokens the ingress's answers from this replica say were computed for them."""
        row = next(r for r in info(cluster)["replicas"] if r["replica"] == replica)
        return row["input_tokens"] - row["cached_tokens"]

    def exported() -> dict[str, list] | None:
        # every answer this replica gave went through the ingress: once the export has caught up, what the answers
        # were billed adds up to what the replica counted as computed
        got = mine()
        computed = [s.value for s in got.get("ray_blink_replica_prompt_tokens", []) if s.labels["source"] == "computed"]
        return got if computed and computed[0] == billed() else None

    families = poll(exported, 120, every_s=1.0)  # the metrics agent exports every few seconds
    assert families, "no blink_replica metric of this replica on its node's metrics export"
    by_name = {name.removeprefix("ray_"): samples for name, samples in families.items()}
    tokens = {s.labels["source"]: s.value for s in by_name["blink_replica_prompt_tokens"]}
    assert tokens["computed"] > 0 and all(
        s.labels["model"] == blink.STANDIN_MODEL for s in families[next(iter(families))]
    )
    assert sum(s.value for s in by_name["blink_replica_model_seconds"]) > 0
    packs = [s for s in by_name["blink_replica_forward_requests"] if s.name.endswith("_count")]
    assert packs and sum(s.value for s in packs) >= 1  # forwards counted, each with its requests
    assert "blink_replica_waiting" in by_name


# ------------------------------------------------------------------------------------------------------------------
# Without a cluster: the routing rule, the app's arguments, its config file and Serve's refusals
# ------------------------------------------------------------------------------------------------------------------

KEYS = [f"document {n}" for n in range(600)]


def test_rendezvous_gives_each_key_one_home_and_moves_only_the_leavers_share():
    three = ["r1", "r2", "r3"]
    homes = {k: serve_app.ranked(k, three)[0] for k in KEYS}
    shares = {r: sum(h == r for h in homes.values()) for r in three}
    assert all(150 < n < 250 for n in shares.values()), shares  # about a third each
    assert all(serve_app.ranked(k, list(reversed(three)))[0] == homes[k] for k in KEYS)  # not by list order
    left = {k: serve_app.ranked(k, ["r1", "r3"])[0] for k in KEYS}  # r2 leaves: only its keys move
    assert all(left[k] == homes[k] for k in KEYS if homes[k] != "r2")
    joined = {k: serve_app.ranked(k, [*three, "r4"])[0] for k in KEYS}  # r4 joins: keys move only to it
    assert all(joined[k] in (homes[k], "r4") for k in KEYS) and 100 < sum(h == "r4" for h in joined.values()) < 200


def test_a_request_goes_home_until_home_leads_the_least_loaded_by_more_than_the_threshold():
    key = KEYS[0]
    home, second, third = serve_app.ranked(key, ["r1", "r2", "r3"])
    assert serve_app.pick(key, {home: 5, second: 0, third: 0}, 5) == home
    assert serve_app.pick(key, {home: 6, second: 0, third: 0}, 5) == second  # the tie goes to the next in rank
    assert serve_app.pick(key, {home: 6, second: 1, third: 0}, 5) == third
    assert serve_app.pick(key, {home: 1, second: 0, third: 0}, 0) == second
    assert serve_app.pick(None, {"r2": 1, "r1": 0, "r3": 0}, 5) == "r1"  # no key: the least loaded


PRICE = serve_app.Price(evidence=3400, questions=60)


def sent(picker: serve_app.EvidencePicker, key: str, replicas: list[str], ticket: str) -> str:
    """One request over `key` picked and sent where the picker said; the replica."""
    replica = picker.pick(key, PRICE, replicas, ticket)
    picker.routed(ticket, replica)
    return replica


def test_bounded_loads_keep_one_home_per_document_that_fits_and_cap_each_replicas_documents():
    picker = serve_app.EvidencePicker(serve_app.RouteSettings())
    four = ["r1", "r2", "r3", "r4"]
    homes = {}
    for n, key in enumerate(KEYS[:200]):  # one at a time, each answered before the next: no queue to balance
        homes[key] = sent(picker, key, four, f"t{n}")
        picker.done(f"t{n}")
    counts = collections.Counter(homes.values())
    assert max(counts.values()) <= math.ceil(1.25 * 200 / 4), counts  # c x the mean, as the paper's capacity
    assert sum(homes[k] == serve_app.ranked(k, four)[0] for k in homes) > 150  # most stay at their rendezvous home
    for n, key in enumerate(KEYS[:200]):  # asked again, one at a time: every document at its one home
        assert sent(picker, key, four, f"again{n}") == homes[key]
        picker.done(f"again{n}")
    assert all(len(h) == 1 for h in picker.homes.values()) and picker.total_queued == 0


def test_a_new_document_skips_a_replica_whose_queued_tokens_pass_the_bound():
    picker = serve_app.EvidencePicker(serve_app.RouteSettings())
    two = ["r1", "r2"]
    key = KEYS[0]
    home, other = serve_app.ranked(key, two)
    for n in range(3):  # three new documents queued at the home, each priced with its evidence
        picker.pick(KEYS[1 + n], PRICE, two, f"q{n}")
        picker.routed(f"q{n}", home)
    assert picker.queued[home] == 3 * PRICE.at(False)
    assert picker.pick(key, PRICE, two, "new") == other  # over 1.25 x the mean of queued tokens: the next in rank


def test_a_hot_document_gets_a_home_for_every_hot_share_of_the_recent_requests_it_draws():
    picker = serve_app.EvidencePicker(serve_app.RouteSettings(hot=1.5, window=4))
    four = ["r1", "r2", "r3", "r4"]
    hot = KEYS[0]
    picks = []
    for n in range(16):  # the window: 4 x 4 recent requests; a home per 1.5 x 4 of them the document draws
        picks.append(sent(picker, hot, four, f"h{n}"))
    homes = picker.homes[hot]
    assert len(homes) == math.ceil(16 / 6) == 3 and homes[0] == serve_app.ranked(hot, four)[0]
    assert picks[:6] == [homes[0]] * 6 and picks[6] == homes[1]  # the seventh request opens the second home
    assert set(picks) == set(homes)  # and every request went to one of its homes, none answered: the least queued
    for n in range(16):  # other documents fill the window: the hot one's share falls, its homes stay (kept evidence)
        picker.done(f"h{n}")
        sent(picker, KEYS[1 + n], four, f"o{n}")
    assert picker.homes[hot] == homes and sent(picker, hot, four, "later") in homes


def test_a_join_moves_only_the_documents_the_joiner_ranks_first_and_a_leave_only_the_leavers():
    picker = serve_app.EvidencePicker(serve_app.RouteSettings())
    three = ["r1", "r2", "r3"]
    for n, key in enumerate(KEYS):
        sent(picker, key, three, f"t{n}")
        picker.done(f"t{n}")
    before = {k: h[0] for k, h in picker.homes.items()}
    picker.update([*three, "r4"])
    after = {k: h[0] for k, h in picker.homes.items()}
    moved = [k for k in KEYS if after[k] != before[k]]
    assert all(after[k] == "r4" and serve_app.ranked(k, [*three, "r4"])[0] == "r4" for k in moved)
    assert len(moved) == picker.moved and len(moved) <= math.ceil(1.25 * len(KEYS) / 4)
    picker.update(["r1", "r3", "r4"])  # r2 leaves: its documents, and only those, lose their home
    assert picker.moved - len(moved) == sum(h == "r2" for h in after.values())
    assert all(picker.homes[k] == [after[k]] for k in KEYS if after[k] != "r2")


def test_rule_lead_is_the_earlier_rule():
    picker = serve_app.EvidencePicker(serve_app.RouteSettings(rule="lead", max_lead=1))
    three = ["r1", "r2", "r3"]
    key = KEYS[0]
    home, second, _ = serve_app.ranked(key, three)
    assert [sent(picker, key, three, f"t{n}") for n in range(3)] == [home, home, second]


def test_the_app_arguments_are_read_and_refused_by_name(monkeypatch):
    args = serve_app.AppArgs.read({"min_replicas": "1", "max_replicas": 3, "autoscaling": {"upscale_delay_s": 0}})
    assert args.autoscaling_config() == {"upscale_delay_s": 0, "min_replicas": 1, "max_replicas": 3}
    assert serve_app.AppArgs.read({"replicas": "2"}).autoscaling_config() is None
    for bad, message in [
        ({"replica": "2"}, "unknown argument 'replica'; the app takes autoscaling, gpus, max_replicas"),
        ({"replicas": "0"}, "replicas must be a whole number of at least 1 (got '0')"),
        ({"routing": "round_robin"}, "routing must be one of evidence, pow2, prefix_tree (got 'round_robin')"),
        ({"threads": "two"}, "threads must be a whole number of at least 1 (got 'two')"),
        ({"max_replicas": "2"}, "min_replicas and max_replicas go together"),
        ({"min_replicas": "3", "max_replicas": "2"}, "min_replicas must not be above max_replicas"),
        ({"autoscaling": "[1]"}, "autoscaling must be a JSON object"),
    ]:
        with pytest.raises(blink.BlinkError) as refused:
            serve_app.AppArgs.read(bad)
        assert str(refused.value).startswith(message), (bad, str(refused.value))
    monkeypatch.setenv("BLINK_ROUTE_MAX_LEAD", "-1")
    with pytest.raises(SystemExit, match="^blink: BLINK_ROUTE_MAX_LEAD must be a whole number of at least 0"):
        serve_app.app({})


def test_the_config_file_is_serves_and_builds_the_app():
    import yaml
    from ray.serve.schema import ServeDeploySchema

    with open(os.path.join(ROOT, "adapters", "serve.yaml")) as fh:
        config = ServeDeploySchema.model_validate(yaml.safe_load(fh))
    (application,) = config.applications
    assert application.import_path == "adapters.serve:app"
    built = serve_app.app(application.args)
    assert isinstance(built, serve.Application)


@pytest.mark.parametrize("protocol", [wire.SYSTEM_ONE, wire.DECISIONS])
def test_serves_own_refusals_are_the_503_a_full_queue_gets(protocol):
    from ray.serve._private.common import DeploymentID
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    full = wire.reply(protocol, None, blink.BlinkBusy("busy: 256 requests are already waiting; retry shortly"))
    for exc, says in [
        (BackPressureError(num_queued_requests=64, max_queued_requests=64), "Serve's queue in front of them is full"),
        (DeploymentUnavailableError(DeploymentID(name="Replica", app_name=APP)), "no replica is running"),
    ]:
        status, headers, body = wire.reply(protocol, None, serve_app.serve_refusal(exc))
        assert (status, headers["retry-after"]) == (full[0], full[1]["retry-after"]) == (503, "1")
        assert json.loads(body).keys() == json.loads(full[2]).keys() and "overloaded" in body and says in body


def test_the_readmes_system_one_and_decisions_examples_are_answered_by_the_ingress(
    cluster, scaled, standin, served, tmp_path
):
    """README's typesafe-sdk and openai examples, run as written but for the URL and the key, print the choice and
    p(yes) in-process decide() gives README's question."""
    from test_readme import TICKET, code_blocks, run_example

    examples = [c for lang, c in code_blocks("Calling it from code") if "typesafe_sdk" in c or "from openai" in c]
    assert len(examples) == 2 and all('api_key="any-key"' in c for c in examples)
    want = served(standin).decide(
        TICKET,
        {
            "queue": {"type": "choice", "instructions": "Which team?", "criteria": ["billing", "access", "bug"]},
            "urgent": {"type": "noul", "instructions": "Is the customer blocked right now?"},
        },
    )["answers"]
    for code in examples:
        keyed = code.replace('api_key="any-key"', f'api_key="{KEY}"')
        choice, p_yes, model = run_example("python", keyed, cluster, tmp_path).splitlines()[-1].split()
        assert choice == want["queue"]["choice"] and abs(float(p_yes) - want["urgent"]["noul"]) < 1e-5
        assert model in (blink.STANDIN_MODEL, wire.DEFAULT_MODEL_ALIAS)
