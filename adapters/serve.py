"""blink on Ray Serve: replicas that each hold one blink.Deployment, behind an ingress that serves the same HTTP layer
as app.py (adapters/http.py), each request routed to the replica that holds its evidence.

  serve run adapters.serve:app replicas=2     from the repo root; key=value pairs are the app's arguments (AppArgs)
  serve deploy adapters/serve.yaml            on a running cluster; the same arguments under `args`

Arguments: replicas=N, or min_replicas/max_replicas (Serve's autoscaling; `autoscaling` takes any other field of
Serve's AutoscalingConfig as a JSON object); threads (torch threads and CPUs per replica); gpus (per replica);
routing (evidence, pow2 or prefix_tree); models ("repo[@rev],repo2"; default: the replicas' BLINK_MODELS or
BLINK_MODEL). Every other setting is a BLINK_* variable, read by each process from its own environment (Serve's
runtime_env env_vars on a cluster); the replicas' blink.Settings are the ones the ingress parses requests with.

A request: Serve's proxy -> the Ingress, whose HTTP layer does what app.py's does (key, room, body, parsed into a
WireCall) -> ServeLayer.decided: the evidence key computed once from the parsed request (evidence_key) -> the
Replica deployment's handle, whose RequestRouter picks a replica -> Replica.decide: Deployment.submit in a thread
(the replica's Batcher packs it with every other request it holds) -> {answers, meta} with meta.replica, or the
refusal as the WireError app.py would reply with -> back at the ingress, shaped by the protocol. The answers and
errors are app.py's, byte for byte, bar the meta's timings and `replica`.

Routing, policy `evidence` (EvidenceRouter over EvidencePicker): a replica's prefix cache keeps prompts by their
token ids through the evidence, and those follow from the model and the evidence alone, so the evidence key names
exactly what a replica may hold. By default (BLINK_ROUTE_RULE=bounded) consistent hashing with bounded loads: a new
document goes to the first replica in its rendezvous (highest-random-weight) ranking whose documents and queued
prompt tokens are within BLINK_ROUTE_BALANCE times the mean, and stays there; a document drawing more than
BLINK_ROUTE_HOT replicas' fair shares of the recent requests gets another home per such share; a replica joining or
leaving moves only its own share. Rule `lead` is the earlier one: the rendezvous home unless it holds more than
BLINK_ROUTE_MAX_LEAD requests beyond the least loaded replica. Only one replica is offered at a time: Serve moves past
an offered replica whose queue-length probe misses its deadline, which a replica busy in a forward often does, so
offering a ranked list would split documents by accident.
`pow2` is Serve's default router, `prefix_tree` Ray Serve LLM's PrefixCacheAffinityRouter over the request's text;
both are here to compare against.

Faults and load: a replica that dies mid-request raises at the ingress, which asks again (routing has dropped the
dead replica; a decision is a pure function of its request, so asking twice is safe) and the caller gets one reply;
Serve starts a replacement. The ingress takes BLINK_CONCURRENCY requests at once and BLINK_QUEUE_SIZE waiting, past
that 503 with Retry-After (as app.py); Serve's own queue in front of the replicas (max_queued_requests, the same
BLINK_QUEUE_SIZE) refuses as the same 503.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import importlib.util
import json
import logging
import math
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import anyio
import ray
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.exceptions import RayActorError
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTreeActor
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

import blink
from adapters import http, wire

log = logging.getLogger("blink.serve")
POLICIES = ("evidence", "pow2", "prefix_tree")
RULES = ("bounded", "lead")  # policy evidence's rules (EvidencePicker)
ATTEMPTS = 3  # tries per request: a replica that dies mid-request is one, whichever replica then answers another
HEALTH_CHECK_TIMEOUT_S = 60  # a replica busy in forwards on a loaded CPU answers Serve's health check late

# ==================================================================================================================
# Settings and arguments
# ==================================================================================================================


@dataclass(frozen=True)
class RouteSettings:
    """The router's own settings, each BLINK_* variable once (blink.Settings holds the engine's, ServerSettings the
    HTTP layer's)."""

    rule: str = blink.setting("BLINK_ROUTE_RULE", "bounded", choices=RULES)  # EvidencePicker: bounded loads, or
    # `lead` (the rule of earlier versions: a document's home unless it leads the least loaded by max_lead requests)
    balance: float = blink.setting("BLINK_ROUTE_BALANCE", 1.25, 1.0)  # c: a replica takes a new document while its
    # documents and its queued prompt tokens are within c times the mean
    hot: float = blink.setting("BLINK_ROUTE_HOT", 1.5, above=True, lo=0.0)  # a document gets a home for every this
    # many replicas' fair shares of the recent requests it draws (its load share; past 1.5 shares, a second home)
    window: int = blink.setting("BLINK_ROUTE_WINDOW", 16, 1)  # recent requests, per replica, the shares count over
    documents: int = blink.setting("BLINK_ROUTE_DOCUMENTS", 65536, 1)  # documents whose homes the router remembers
    max_lead: int = blink.setting("BLINK_ROUTE_MAX_LEAD", 4, 0)  # rule `lead`: requests in flight a document's home
    # may hold beyond the least loaded replica before a request over that document goes to the least loaded instead

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RouteSettings:
        """Route settings from the environment (default: os.environ), each variable checked and refused by name."""
        return cls(**blink.env_values(cls, os.environ if env is None else env))


@dataclass(frozen=True)
class AppArgs:
    """The app's arguments (`serve run adapters.serve:app key=value ...`, or a config file's `args`), each read and
    refused by name as blink reads its variables."""

    replicas: int = blink.setting("replicas", 1, 1)  # a fixed number of replicas
    min_replicas: int | None = blink.setting("min_replicas", None, 1, kind=int)  # with max_replicas: autoscaling
    max_replicas: int | None = blink.setting("max_replicas", None, 1, kind=int)
    autoscaling: str = blink.setting("autoscaling", "{}", json_object=True)  # more AutoscalingConfig fields
    threads: int = blink.setting("threads", 1, 1)  # torch threads, and CPUs Ray reserves, per replica
    gpus: float = blink.setting("gpus", 0.0, 0.0)  # GPUs per replica
    routing: str = blink.setting("routing", "evidence", choices=POLICIES)
    models: str | None = blink.setting("models", None)  # "repo[@rev],repo2"; None: the replicas' environment's

    @classmethod
    def read(cls, args: Mapping[str, object]) -> AppArgs:
        """The arguments Serve passes the app builder (text from `serve run`, any JSON value from a config file)."""
        known = {f.metadata["env"] for f in fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise blink.BlinkError(f"unknown argument {unknown[0]!r:.80}; the app takes {', '.join(sorted(known))}")
        text = {k: json.dumps(v) if isinstance(v, dict) else str(v) for k, v in args.items() if v is not None}
        parsed = cls(**blink.env_values(cls, text))
        if (parsed.min_replicas is None) != (parsed.max_replicas is None):
            raise blink.BlinkError("min_replicas and max_replicas go together (autoscaling between them)")
        if parsed.autoscaling != "{}" and parsed.max_replicas is None:
            raise blink.BlinkError("autoscaling needs min_replicas and max_replicas")
        if parsed.max_replicas is not None and parsed.min_replicas > parsed.max_replicas:
            raise blink.BlinkError("min_replicas must not be above max_replicas")
        return parsed

    def autoscaling_config(self) -> dict | None:
        """Serve's autoscaling_config for the replicas (None: a fixed number of them)."""
        if self.max_replicas is None:
            return None
        return {**json.loads(self.autoscaling), "min_replicas": self.min_replicas, "max_replicas": self.max_replicas}


def served_settings(models: str | None) -> blink.Settings:
    """The engine's settings of this process's environment, serving `models` when given."""
    env = dict(os.environ)
    if models:
        env["BLINK_MODELS"] = models
    return blink.Settings.from_env(env)


# ==================================================================================================================
# What travels from the ingress to a replica
# ==================================================================================================================


def evidence_key(model: str, request: blink.Request) -> str:
    """What a replica's prefix cache keeps for this request, named: its prompts' token ids through the evidence follow
    from the model and the evidence as the prompts write it (blink.evidence_json), with the listed images beside."""
    digest = hashlib.sha256(model.encode("utf-8"))
    for part in (blink.evidence_json(request.state), *request.images):
        digest.update(b"\0" + part.encode("utf-8"))
    return digest.hexdigest()[:32]


@dataclass(frozen=True)
class Ask:
    """One request for a replica: parsed once at the ingress, with its model and evidence key."""

    request: blink.Request
    model: str
    key: str
    price: Price

    @property
    def prompt(self) -> str:
        """The request as text, evidence first, for routers that match prompts by their characters (prefix_tree)."""
        return blink.evidence_json(self.request.state) + json.dumps(self.request.spec, ensure_ascii=False)


def price_of(request: blink.Request) -> Price:
    """A request's price in prompt tokens, from its characters (about CHARS_PER_TOKEN a token; images at their
    data's length): its evidence once, its questions' own text."""
    evidence = len(blink.evidence_json(request.state)) + sum(len(i) for i in request.images)
    questions = len(json.dumps(request.spec, ensure_ascii=False))
    return Price(-(-evidence // CHARS_PER_TOKEN), -(-questions // CHARS_PER_TOKEN))


# ==================================================================================================================
# Routing
# ==================================================================================================================

ROUTERS: dict[str, Roster] = {}  # this process's router for each app's replicas (the ingress reads it for /info)
CHARS_PER_TOKEN = 4  # the router prices a request by its characters (the ingress holds no tokenizer): ~4 a token
PRICED_KEPT = 10_000  # picks remembered until Serve says where the request went (a request never sent is dropped)


def routers() -> dict[str, Roster]:
    """ROUTERS of this module as the process imported it. Serve ships a router's module to the process that routes
    by value, so the router's own globals are copies; it registers here, where the ingress reads."""
    return importlib.import_module(__name__).ROUTERS


def rendezvous(key: str, replica: str) -> int:
    """A replica's weight for a key: the replica with the highest weight is the key's home."""
    return int.from_bytes(hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest(), "big")


def ranked(key: str, replicas: list[str]) -> list[str]:
    """Replica ids from a key's home down (rendezvous hashing)."""
    return sorted(replicas, key=lambda r: rendezvous(key, r), reverse=True)


def pick(key: str | None, loads: Mapping[str, int], max_lead: int) -> str:
    """Rule `lead` (the rule until bounded loads): the key's rendezvous home, unless the home holds more than
    max_lead requests beyond the least loaded replica, then the least loaded (nearest the home on a tie). Without a
    key: the least loaded."""
    order = ranked(key, list(loads)) if key is not None else sorted(loads)
    least = min(order, key=lambda r: loads[r])
    home = order[0]
    return home if loads[home] - loads[least] <= max_lead else least


@dataclass(frozen=True)
class Price:
    """What a request costs the replica that answers it, in prompt tokens to compute: its evidence (once, however
    many questions show it; nothing where the replica already holds it) and its questions' own tokens."""

    evidence: int
    questions: int

    def at(self, holds: bool) -> int:
        """Tokens to compute on a replica that holds the evidence (`holds`) or does not."""
        return self.questions + (0 if holds else self.evidence)


class EvidencePicker:
    """Policy `evidence`'s choice, apart from Serve (a pure object: bench/route_sim.py drives this same code).

    Rule `bounded` (the default): consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam 2018;
    HAProxy's hash-balance-factor), by prompt tokens. A document (an evidence key) seen for the first time goes to
    the first replica in its rendezvous ranking whose share of documents and of queued prompt tokens is within
    `balance` (c) times the mean, and stays there: its home, where its evidence is kept. A request over a known
    document goes to its home, unless the document is hot: one replica's fair share of the recent requests (the
    last `window` per replica) is `window`, and a document gets a home for every `hot` fair shares it draws, each
    the next replica in its ranking within the bound; its requests take whichever of its homes has the fewest queued
    tokens (SGLang's router leaves the cache for the shortest queue past an absolute and a relative imbalance; here
    the overflow keeps to the document's homes, which hold its evidence). A replica that joins takes the
    documents it now ranks first for (rendezvous hashing's share, while within the bound); one that leaves hands its
    documents on at their next request. Rule `lead`: pick() over requests in flight, the rule of earlier versions.
    """

    def __init__(self, settings: RouteSettings):
        self.settings = settings
        self.homes: collections.OrderedDict[str, list[str]] = collections.OrderedDict()  # key -> homes, LRU order
        self.top: dict[str, tuple[int, str]] = {}  # key -> (weight, replica) of its rendezvous top among the live
        self.documents: collections.Counter[str] = collections.Counter()  # replica -> documents it is first home of
        self.queued: collections.Counter[str] = collections.Counter()  # replica -> prompt tokens sent, not answered
        self.in_flight: collections.Counter[str] = collections.Counter()  # replica -> requests sent, not answered
        self.priced: collections.OrderedDict[str, int] = collections.OrderedDict()  # ticket -> tokens, until sent
        self.sent: dict[str, tuple[str, int]] = {}  # ticket -> (replica, tokens), until answered
        self.recent_keys: collections.deque = collections.deque()  # the keys of the recent requests, oldest first
        self.recent: collections.Counter[str | None] = collections.Counter()  # key -> requests among the recent
        self.total_queued = 0  # the sum of `queued`, and of `documents` over the live replicas, kept as they change
        self.total_documents = 0
        self.replicas: list[str] = []
        self.moved = 0  # documents whose first home changed because a replica joined or left

    # ---- membership ----------------------------------------------------------------------------------------------

    def update(self, replicas: list[str]) -> None:
        """Serve's new replica set: a joiner takes the known documents it now ranks first for, within the bound."""
        joined = [r for r in replicas if r not in self.replicas]
        left = set(self.replicas) - set(replicas)
        self.replicas = list(replicas)
        for r in left:
            self.total_documents -= self.documents.pop(r, 0)
        if self.settings.rule != "bounded" or not self.homes:
            return
        for key, homes in self.homes.items():
            kept = [h for h in homes if h not in left]
            if len(kept) != len(homes):
                self.homes[key] = kept
                if homes[0] in left:
                    self.moved += 1
                    if kept:
                        self.documents[kept[0]] += 1
                        self.total_documents += 1
        others = [r for r in replicas if r not in joined]
        for key, top in self.top.items():  # the rendezvous top among the replicas left, where it was a leaver
            if top[1] in left and others:
                self.top[key] = max((rendezvous(key, r), r) for r in others)
        for j in joined:  # one hash a known document: a joiner is its new top where its weight beats the top's
            for key, homes in self.homes.items():
                weight = rendezvous(key, j)
                if weight > self.top.get(key, (-1, None))[0]:
                    self.top[key] = (weight, j)
                    if homes and others and self.within_documents(j, adding=1):
                        self.documents[homes[0]] -= 1
                        self.documents[j] += 1
                        self.homes[key] = [j]
                        self.moved += 1

    # ---- the pick ------------------------------------------------------------------------------------------------

    def pick(self, key: str | None, price: Price, replicas: list[str], ticket: str | None = None) -> str:
        """The replica for a request over `key` costing `price`, among `replicas` (the live ones)."""
        if set(replicas) != set(self.replicas):
            self.update(replicas)
        if ticket is None or ticket not in self.priced:  # Serve asks again for a request it could not place
            self.count(key, len(replicas))
        if self.settings.rule == "lead":
            chosen = pick(key, {r: self.in_flight[r] for r in replicas}, self.settings.max_lead)
            holds = True
        elif key is None:
            chosen, holds = min(sorted(replicas), key=lambda r: (self.queued[r], self.in_flight[r])), False
        else:
            chosen, holds = self.bounded(key, price, replicas)
        if ticket is not None:
            self.priced[ticket] = price.at(holds)
            self.priced.move_to_end(ticket)
            while len(self.priced) > PRICED_KEPT:
                self.priced.popitem(last=False)
        return chosen

    def bounded(self, key: str, price: Price, replicas: list[str]) -> tuple[str, bool]:
        """Rule `bounded`: (the replica, whether it holds the evidence already)."""
        homes = [h for h in self.homes.get(key, []) if h in replicas]
        if not homes:  # a new document (or one whose homes all left): its first home within the bound
            order = ranked(key, replicas)
            self.top[key] = (rendezvous(key, order[0]), order[0])
            home = next((r for r in order if self.within(r, price.at(False), documents=True)), None)
            home = home or min(order, key=lambda r: self.queued[r])
            self.remember(key, [home])
            self.documents[home] += 1
            self.total_documents += 1
            return home, False
        self.remember(key, homes)
        wanted = min(len(replicas), math.ceil(self.recent[key] / (self.settings.hot * self.settings.window)))
        if len(homes) >= wanted:
            return min(homes, key=lambda r: (self.queued[r], homes.index(r))), True
        spare = [r for r in ranked(key, replicas) if r not in homes]  # hot: another home, the next within the bound
        extra = next((r for r in spare if self.within(r, price.at(False))), None)
        extra = extra or min(spare, key=lambda r: self.queued[r])
        self.homes[key] = [*homes, extra]
        return extra, False

    def count(self, key: str | None, replicas: int) -> None:
        """One more request over `key` among the recent ones (the last `window` per replica)."""
        self.recent_keys.append(key)
        self.recent[key] += 1
        while len(self.recent_keys) > self.settings.window * replicas:
            gone = self.recent_keys.popleft()
            self.recent[gone] -= 1
            if not self.recent[gone]:
                del self.recent[gone]

    def within(self, replica: str, tokens: int, documents: bool = False) -> bool:
        """Whether `replica` may take a new document (or another home of one): its queued tokens within c times the
        mean with these `tokens` added, and (for a new document) its documents within c times the mean."""
        fits = self.queued[replica] <= self.settings.balance * (self.total_queued + tokens) / len(self.replicas)
        return fits and (not documents or self.within_documents(replica, adding=1))

    def within_documents(self, replica: str, adding: int) -> bool:
        """Whether `replica`'s documents, `adding` more, stay within c times the mean (rounded up, as the paper's
        capacity ceil(c m / n))."""
        total = self.total_documents + adding
        return self.documents[replica] + adding <= math.ceil(self.settings.balance * total / len(self.replicas))

    def remember(self, key: str, homes: list[str]) -> None:
        """A document's homes, kept as the most recent; past the settings' bound the least recent is forgotten."""
        self.homes[key] = homes
        self.homes.move_to_end(key)
        while len(self.homes) > self.settings.documents:
            forgotten, gone = self.homes.popitem(last=False)
            self.top.pop(forgotten, None)
            if gone and gone[0] in self.documents:
                self.documents[gone[0]] -= 1
                self.total_documents -= 1

    # ---- what came of it -----------------------------------------------------------------------------------------

    def routed(self, ticket: str, replica: str) -> None:
        """Serve sent the request `ticket` to `replica`: its tokens are queued there."""
        tokens = self.priced.pop(ticket, 0)
        self.sent[ticket] = (replica, tokens)
        self.queued[replica] += tokens
        self.total_queued += tokens
        self.in_flight[replica] += 1

    def done(self, ticket: str) -> None:
        """The request `ticket` came back (answered, failed or refused): its tokens leave its replica's queue."""
        replica, tokens = self.sent.pop(ticket, (None, 0))
        if replica is not None:
            self.queued[replica] -= tokens
            self.total_queued -= tokens
            self.in_flight[replica] -= 1


class Roster:
    """What every policy's router here adds to Serve's (a mixin before the router class): the live replicas, the
    requests each was sent and has not answered (the router's own counts, from Serve's routed and completed hooks),
    registered in ROUTERS for the ingress's /info."""

    def initialize_state(self, **kwargs) -> None:
        """Counts start at zero; the router registers under its app's name."""
        self.in_flight: collections.Counter[str] = collections.Counter()
        self.sent: dict[str, str] = {}  # internal request id -> replica id, for requests not answered yet
        self.nodes: dict[str, str] = {}  # replica id -> node id, for the live replicas
        self.roster_lock = threading.Lock()
        super().initialize_state(**kwargs)
        routers()[self.app_name] = self

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new replica set, noted."""
        super().update_replicas(replicas)
        with self.roster_lock:
            self.nodes = {r.replica_id.unique_id: r.node_id for r in replicas}

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """A dead replica leaves the roster at once (Serve's own update follows later)."""
        super().on_replica_actor_died(replica_id)
        with self.roster_lock:
            self.nodes.pop(replica_id.unique_id, None)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        """A replica accepted a request: one more in flight there."""
        super().on_request_routed(pending_request, replica_id, result)
        with self.roster_lock:
            self.sent[pending_request.metadata.internal_request_id] = replica_id.unique_id
            self.in_flight[replica_id.unique_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """A request came back (answered, failed or refused): one fewer in flight where it was accepted."""
        super().on_request_completed(replica_id, internal_request_id)
        with self.roster_lock:
            replica = self.sent.pop(internal_request_id, None)
            if replica is not None:
                self.in_flight[replica] -= 1

    def loads(self, replicas: list[str]) -> dict[str, int]:
        """Requests in flight on each of `replicas`, by the router's own counts."""
        with self.roster_lock:
            return {r: self.in_flight[r] for r in replicas}

    def roster(self) -> dict[str, dict]:
        """The live replicas: each one's node and requests in flight."""
        with self.roster_lock:
            return {r: {"node": node, "in_flight": self.in_flight[r]} for r, node in self.nodes.items()}


class EvidenceRouter(Roster, RequestRouter):
    """Policy `evidence`: each request where EvidencePicker says, by its evidence key and price; one replica offered
    at a time."""

    def initialize_state(self, route: dict | None = None, **kwargs) -> None:
        """The picker, with the app's RouteSettings (as a dict: Serve passes the router's arguments by value)."""
        self.picker = EvidencePicker(RouteSettings(**(route or {})))
        super().initialize_state(**kwargs)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """The one replica the picker names among the candidates."""
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        args = pending_request.args if pending_request is not None else []
        # by attribute: Serve ships this module to the routing process by value, so its Ask is not the callers' class
        key, price = (getattr(args[0], "key", None), getattr(args[0], "price", None)) if args else (None, None)
        ticket = pending_request.metadata.internal_request_id if pending_request is not None else None
        with self.roster_lock:
            priced = Price(price.evidence, price.questions) if price else Price(0, 0)
            chosen = self.picker.pick(key, priced, sorted(by_id), ticket)
        return [[by_id[chosen]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        """The picker queues the request's tokens where it went."""
        super().on_request_routed(pending_request, replica_id, result)
        with self.roster_lock:
            self.picker.routed(pending_request.metadata.internal_request_id, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """The picker takes the request's tokens off its replica's queue."""
        super().on_request_completed(replica_id, internal_request_id)
        with self.roster_lock:
            self.picker.done(internal_request_id)


class Pow2Router(Roster, PowerOfTwoChoicesRequestRouter):
    """Policy `pow2`: Serve's default router (power of two choices), with the roster."""


class PrefixTreeRouter(Roster, PrefixCacheAffinityRouter):
    """Policy `prefix_tree`: Ray Serve LLM's PrefixCacheAffinityRouter (a character prefix tree over each request's
    text), with the roster. Its tree lives in an actor of its own, here owned by the router and holding no CPU (the
    detached one it would make waits for a free CPU, which a cluster full of replicas does not have)."""

    def initialize_state(self, **kwargs) -> None:
        """Ray's router state, over a tree actor of the router's own."""
        kwargs.setdefault("tree_actor", PrefixTreeActor.options(num_cpus=0).remote())
        super().initialize_state(**kwargs)


ROUTER_CLASSES = {"evidence": EvidenceRouter, "pow2": Pow2Router, "prefix_tree": PrefixTreeRouter}


def router_config(policy: str, route: RouteSettings) -> RequestRouterConfig:
    """Serve's RequestRouterConfig for a policy."""
    kwargs = {"route": dataclasses.asdict(route)} if policy == "evidence" else {}
    return RequestRouterConfig(request_router_class=ROUTER_CLASSES[policy], request_router_kwargs=kwargs)


# ==================================================================================================================
# A replica: one blink.Deployment
# ==================================================================================================================


class ReplicaMetrics:
    """A replica's forward metrics through Ray's metrics (ray.util.metrics): each node's metrics agent serves them on
    the node's metrics export port, where the cluster's Prometheus scrapes Ray's own, named ray_<name> and labelled
    by model, replica and node: requests per forward, prompt tokens computed and cached, model seconds (what the
    ingress's /metrics counts for app.py's one process) and requests waiting in the replica's Batcher."""

    TAGS = ("model", "replica", "node")

    def __init__(self, deployment: blink.Deployment, replica: str, node: str):
        from ray.util.metrics import Counter, Gauge, Histogram

        self.deployment, self.replica, self.node = deployment, replica, node
        self.packing = Histogram(
            "blink_replica_forward_requests",
            "Requests packed into one live forward of the model, on a Ray Serve replica",
            boundaries=[float(b) for b in http.PACKING_BUCKETS],
            tag_keys=self.TAGS,
        )
        self.tokens = Counter(
            "blink_replica_prompt_tokens",
            "Prompt tokens of a replica's live forwards: computed by the model (source computed) or read from the "
            "prefix cache (source cached)",
            tag_keys=(*self.TAGS, "source"),
        )
        self.model_seconds = Counter(
            "blink_replica_model_seconds", "Seconds a replica's model spent in forward passes", tag_keys=self.TAGS
        )
        self.waiting = Gauge(
            "blink_replica_waiting", "Requests waiting in a replica's Batcher for the model", tag_keys=self.TAGS
        )
        deployment.watch(self.forwards)

    def tags(self, model: str) -> dict[str, str]:
        """The labels of one model's series on this replica."""
        return {"model": model, "replica": self.replica, "node": self.node}

    def forwards(self, model: str, results: list) -> None:
        """One Batcher run (Deployment.watch), counted as the ingress's /metrics counts it (http.forward_figures)."""
        figures = http.forward_figures(results)
        if figures is not None:
            tags = self.tags(model)
            for size in figures.packs:
                self.packing.observe(size, tags=tags)
            for source, count in (("computed", figures.computed), ("cached", figures.cached)):
                if count > 0:  # Ray's counters take positive increments only
                    self.tokens.inc(count, tags={**tags, "source": source})
            if figures.model_seconds > 0:
                self.model_seconds.inc(figures.model_seconds, tags=tags)
        self.count_waiting()

    def count_waiting(self) -> None:
        """The requests waiting in each model's Batcher now."""
        for model, batcher in self.deployment.batchers().items():
            self.waiting.set(batcher.q.qsize(), tags=self.tags(model))


@serve.deployment(name="Replica", health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S)
class Replica:
    """One replica: a blink.Deployment (its engines, Batcher and prefix cache) built from this process's
    environment, its models loaded at start; its requests answered in threads of its own (as many as Serve lets in
    at once), where the Batcher packs them together."""

    def __init__(self, models: str | None, threads: int, at_once: int):
        if importlib.util.find_spec("torch") is not None:
            import torch

            torch.set_num_threads(threads)
        self.deployment = blink.Deployment(served_settings(models))
        for model in self.deployment.models():
            self.deployment.engine(model)
        self.name = serve.get_replica_context().replica_id.unique_id
        self.threads = anyio.CapacityLimiter(at_once)
        self.metrics = ReplicaMetrics(self.deployment, self.name, ray.get_runtime_context().get_node_id())

    def describe(self) -> dict:
        """What the ingress needs to parse requests as this replica would: its settings, each model's engine kind,
        whether it reads images and its image limits, and /v1/models as app.py lists it."""
        engines = {m: self.deployment.engine(m) for m in self.deployment.models()}
        return {
            "settings": self.deployment.settings,
            "engines": {m: (e.name, e.reads_images, e.image_limits, e.compute) for m, e in engines.items()},
            "listing": wire.models_listing(self.deployment),
        }

    async def decide(self, ask: Ask) -> dict | wire.WireError:
        """{answers, meta} with meta.replica, or the request's refusal as the WireError app.py replies with."""
        self.metrics.count_waiting()
        try:
            result = await anyio.to_thread.run_sync(
                self.deployment.submit, ask.request, ask.model, limiter=self.threads
            )
        except Exception as exc:  # noqa: BLE001 - every failure goes back as the refusal app.py would send
            refusal = wire.wire_refusal(exc)
            if refusal.kind == "server_error":
                log.error("request failed on replica %s: %r", self.name, exc)
            return refusal
        result["meta"]["replica"] = self.name
        return result


# ==================================================================================================================
# The ingress: the HTTP layer, deciding through the replicas
# ==================================================================================================================


class ReplicaEngine(blink.Engine):
    """A model's engine as the ingress knows it: what parsing a request needs (its kind, whether it reads images, its
    image limits). It runs nothing: the replicas do."""

    runs_model = True

    def __init__(self, model_id: str, settings: blink.Settings, described: tuple):
        super().__init__(model_id, settings)
        self.name, self.reads_images, self.image_limits, self.described_compute = described

    @property
    def compute(self) -> dict:
        """What computes the replicas' numbers (backend, dtype, kernel)."""
        return self.described_compute

    def run(self, jobs: list[blink.Job]) -> list:
        """Never called: the ingress hands requests to replicas."""
        raise RuntimeError("the ingress runs no model; replicas answer")


@dataclass
class Tally:
    """What one replica answered through this ingress: requests, their prompt tokens and the share read from its
    prefix cache."""

    answered: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0

    def add(self, meta: dict) -> None:
        """One answer's meta, counted."""
        self.answered += 1
        self.input_tokens += int(meta.get("input_tokens") or 0)
        self.cached_tokens += int(meta.get("cached_tokens") or 0)

    def row(self) -> dict:
        """As /info lists it; hit_rate: cached prompt tokens over prompt tokens (null before any)."""
        rate = round(self.cached_tokens / self.input_tokens, 4) if self.input_tokens else None
        return {
            "answered": self.answered,
            "input_tokens": self.input_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": rate,
        }


def busy(message: str) -> blink.BlinkBusy:
    """The refusal a full queue gets (every wire protocol replies 503 with Retry-After to it: wire.wire_refusal)."""
    return blink.BlinkBusy(f"busy: {message}; retry shortly")


def serve_refusal(exc: BackPressureError | DeploymentUnavailableError) -> blink.BlinkBusy:
    """Serve's own refusals as app.py's full queue: its queue in front of the replicas full (max_queued_requests),
    or no replica to take the request."""
    if isinstance(exc, BackPressureError):
        return busy("every replica is busy and Serve's queue in front of them is full")
    return busy("no replica is running")


@dataclass
class ReplicaLine:
    """The ingress's way to the replicas: their handle, their app's name (its router's key in ROUTERS), the tallies
    of what each answered and how many asks were retried after a replica died."""

    handle: DeploymentHandle
    app_name: str
    tallies: dict[str, Tally] = field(default_factory=lambda: collections.defaultdict(Tally))
    retried: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ask(self, ask: Ask) -> dict:
        """A replica's answer to one request (in a wire thread): asked again, up to ATTEMPTS times, when the replica
        dies before answering; Serve's full queue and a deployment with no replicas are 503s."""
        for attempt in range(1, ATTEMPTS + 1):
            try:
                outcome = self.handle.decide.remote(ask).result()
            except (BackPressureError, DeploymentUnavailableError) as exc:
                raise serve_refusal(exc) from None
            except RayActorError as exc:
                with self.lock:
                    self.retried += 1
                log.warning("a replica died answering (try %d of %d): %s", attempt, ATTEMPTS, type(exc).__name__)
                continue
            if isinstance(outcome, Exception):
                raise outcome
            with self.lock:
                self.tallies[outcome["meta"]["replica"]].add(outcome["meta"])
            return outcome
        raise busy(f"the replicas asked died {ATTEMPTS} times")

    def replicas(self) -> list[dict]:
        """Every replica live now or that answered through this ingress: node, requests in flight, tallies."""
        router = routers().get(self.app_name)
        live = router.roster() if router is not None else {}
        with self.lock:
            tallies = {r: t.row() for r, t in self.tallies.items()}
        rows = []
        for replica in sorted(set(live) | set(tallies)):
            row = {"replica": replica, "live": replica in live, **live.get(replica, {"node": None, "in_flight": 0})}
            rows.append({**row, **tallies.get(replica, Tally().row())})
        return rows


class ServeLayer(http.HttpLayer):
    """The HTTP layer whose decisions come from replicas: the same routes, key, room, body and replies as app.py's,
    with /info listing the replicas."""

    def __init__(
        self, deployment: blink.Deployment, settings: http.ServerSettings, line: ReplicaLine, listed: dict, policy: str
    ):
        super().__init__(deployment, settings)
        self.line, self.listed, self.policy = line, listed, policy
        self.router.add_api_route("/info", self.info_page, methods=["GET"])

    def decided(self, call: wire.WireCall) -> dict:
        """{answers, meta} from the replica routing picks, by the request's evidence key."""
        request = call.request
        return self.line.ask(Ask(request, call.model, evidence_key(call.model, request), price_of(request)))

    def decided_many(self, batch: wire.WireBatch) -> list:
        """Each state's {answers, meta} (or its error) from the replica routing picks for it, one state after
        another."""
        out = []
        for call in batch.calls:
            try:
                out.append(self.decided(call))
            except Exception as exc:  # noqa: BLE001 - this state's own error, kept in its place
                out.append(exc)
        return out

    def listing(self) -> dict:
        """/v1/models as a replica lists its models."""
        return self.listed

    def info(self) -> dict:
        """The served models, the routing policy and the replicas with their hit rates."""
        return {
            "models": self.deployment.models(),
            "default_model": self.deployment.default_model,
            "engines": {m: self.deployment.engine(m).name for m in self.deployment.models()},
            "compute": {m: self.deployment.engine(m).compute for m in self.deployment.models()},
            "routing": self.policy,
            "replicas": self.line.replicas(),
            "retried": self.line.retried,
        }

    async def info_page(self, request: HTTPRequest) -> Response:
        """GET /info, behind the key when there is one."""
        try:
            self.check_key(request.headers)
        except wire.WireError as exc:
            return http.plain_refusal(exc)
        return JSONResponse(self.info())


@serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    """The app's front: asks a replica how it parses requests, then serves the HTTP layer over the replicas."""

    async def __init__(self, replicas: DeploymentHandle, policy: str):
        described = await replicas.describe.remote()
        settings = described["settings"]
        engines = {m: ReplicaEngine(m, settings, d) for m, d in described["engines"].items()}
        line = ReplicaLine(replicas, serve.get_replica_context().app_name)
        deployment = blink.Deployment(settings, engines)
        self.layer = ServeLayer(deployment, http.ServerSettings.from_env(), line, described["listing"], policy)

    def __serve_build_asgi_app__(self) -> FastAPI:
        """The ASGI app Serve runs: a FastAPI app with the layer installed."""
        app = FastAPI(title="blink", docs_url=None, redoc_url=None, openapi_url=None)
        self.layer.install(app)
        return app


# ==================================================================================================================
# The app builder
# ==================================================================================================================


def app(args: dict) -> serve.Application:
    """`serve run adapters.serve:app replicas=2`: the Ingress over the Replica deployment, as the arguments and this
    environment's settings say. A bad argument or variable stops the build with one line naming it."""
    try:
        parsed = AppArgs.read(args)
        server, route = http.ServerSettings.from_env(), RouteSettings.from_env()
        engine = served_settings(parsed.models)
    except blink.BlinkError as exc:
        raise SystemExit(f"blink: {exc}") from None
    scaling = parsed.autoscaling_config()
    count = {"autoscaling_config": scaling} if scaling else {"num_replicas": parsed.replicas}
    replicas = Replica.options(
        **count,
        ray_actor_options={"num_cpus": parsed.threads, "num_gpus": parsed.gpus},
        max_ongoing_requests=engine.batch_max_requests,  # what one replica packs into a forward
        max_queued_requests=server.queue_size,
        request_router_config=router_config(parsed.routing, route),
    )
    ingress = Ingress.options(max_ongoing_requests=server.concurrency + server.queue_size + 8)
    return ingress.bind(replicas.bind(parsed.models, parsed.threads, engine.batch_max_requests), parsed.routing)
