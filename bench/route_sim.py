"""Routing simulated: adapters/serve.py's evidence picker against Serve's routers, from two replicas to 256.

    python -m bench route_sim           # the check against serve.json, then 4, 16, 64 and 256 replicas (minutes)
    python -m bench route_sim --quick   # the check, then 4 and 16 replicas

A discrete-event simulation of replicas that answer requests in runs, as blink's Batcher does (everything waiting, up
to MAX_ONGOING, in one run whose answers all come back at its end), each with a prefix cache that keeps the evidence
of its last PREFIX_CACHE_DOCUMENTS documents. The routers:

- `evidence` and `evidence_lead`: adapters.serve.EvidencePicker itself (imported, not copied), under its rule
  `bounded` (the default: bounded loads by queued prompt tokens, more homes for a hot document) and its rule
  `lead` (the rule at 9b62b82: rendezvous home unless it leads the least loaded by BLINK_ROUTE_MAX_LEAD requests).
- `pow2`: Serve's default router as its source reads (ray.serve._private.request_router.pow_2_router): two replicas
  drawn at random, the one with fewer requests in flight (a tie drawn at random).
- `prefix_tree`: Ray Serve LLM's PrefixCacheAffinityRouter as its source reads (ray.llm ... prefix_aware_router):
  the replicas whose prefix tree holds at least 10% of the request's text (here: those whose tree holds its
  document), else the replicas whose trees hold the fewest characters; of those, the fewest in flight. Each tree
  keeps PREFIX_TREE_DOCUMENTS documents (its 400,000-character eviction threshold). In the two-replica check Serve's
  locality rule (the ingress's own node first, which PrefixCacheAffinityRouter applies) is modelled too: the
  candidates are the ingress node's replica; at scale every node has a proxy, so no locality.

What a request costs (COST: each parameter with the run it comes from): prefill seconds per computed prompt token,
per cached prompt token and per question, so a request over a document its replica holds costs its questions' own
tokens and reading the kept evidence, and one over a new document the evidence too. Two replicas on the two-core
machine of serve.json ran each a little slower than one alone (the ingress, Serve's proxy and the clients share the
cores): the factor TWO_REPLICA_SPEED, from serve.json's distinct workload.

The check: serve.json's two-node runs replayed (the same workloads, clients and order; the replicas' ids drawn so
that the documents' rendezvous homes split as they did in the committed run) and each arm's req/s and cached share
set against the committed row (tests/test_route_sim.py holds them within 15%). Then the grid: for each size, Zipf
document popularity (s = 0.8, 1.1) over ten times as many documents as replicas, Poisson arrivals at 50%, 80% and
95% of capacity (the replicas' rate when every document's first ask is its only miss), one replica leaving a third
of the way in and one joining at two thirds: req/s, p50/p99 latency, the cached share against one replica with an
unbounded cache (the ideal), the busiest replica's work over the mean, and the documents a join or a leave moved,
against the leaver's or joiner's share. A PNG per size beside the results (bench/results/route_sim-N.png).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import json
import os
import random

from adapters.serve import EvidencePicker, Price, RouteSettings, ranked
from bench.lib import harness, report, workloads

PREFIX_CACHE_DOCUMENTS = 13  # BLINK_PREFIX_CACHE_MB 1,024 over one ~3,400-token document's keys and values on the
# stand-in (30 layers x 2 x 3 KV heads x 64 x 2 bytes x 3,400 tokens = 78 MB)
PREFIX_TREE_DOCUMENTS = (
    30  # 400,000 characters (PrefixCacheAffinityRouter's eviction threshold) over ~13,000 a document
)
MAX_ONGOING = 32  # BLINK_BATCH_MAX_REQUESTS: what Serve lets a replica hold (max_ongoing_requests)
QUESTIONS = 2  # every request in serve.json asks two questions
EVIDENCE_TOKENS, QUESTION_TOKENS = 3338, 62  # ~3,400 prompt tokens a question (bench/serve.py), of which the share a
# cached ask read from the cache in serve.json (re-ask, one replica: 73.62% of the tokens over 24 of 32 asks cached,
# so 98.16% of a cached ask's tokens) is the evidence
SIZES = {"full": (4, 16, 64, 256), "quick": (4, 16)}
ZIPF = (0.8, 1.1)
LOADS = (0.5, 0.8, 0.95)
ASKS_PER_REPLICA = 100  # requests per run: this many per replica
ARMS = ("evidence", "evidence_lead", "pow2", "prefix_tree")
SERVE_JSON = os.path.join(harness.RESULTS, "serve.json")


# ---------------------------------------------------------------------------------------------------------------
# The cost model, fitted to measured runs
# ---------------------------------------------------------------------------------------------------------------


def fitted_cost(serve: dict, overhead: dict) -> dict:
    """Seconds per computed token, per cached token and per question, and the two-replica speed factor, each with the
    figures and the command it comes from."""
    rows = {(r["workload"], r["arm"]): r for r in serve["rows"] if "lead" not in r}
    per_question = overhead["rows"]["defaults"]["decide_ms"] / 1000  # a short question's whole decide()
    cold = rows[("distinct", "one_replica")]["wall_s"] / rows[("distinct", "one_replica")]["requests"]
    reask = rows[("reask", "one_replica")]
    docs, asks = serve["config"]["docs"], serve["config"]["asks"]
    warm = (reask["wall_s"] - docs * cold) / (docs * (asks - 1))
    per_token = (cold - QUESTIONS * per_question) / (EVIDENCE_TOKENS + QUESTIONS * QUESTION_TOKENS)
    per_cached = (warm - QUESTIONS * per_question - per_token * QUESTIONS * QUESTION_TOKENS) / (
        QUESTIONS * EVIDENCE_TOKENS
    )
    # two replicas: the distinct workload (no cache to keep) under pow2 and evidence against one replica's time for
    # the same requests split as they were
    speeds = [
        (max(rows[("distinct", arm)]["by_replica"]) * cold) / rows[("distinct", arm)]["wall_s"]
        for arm in ("pow2", "evidence")
    ]
    serve_cmd, overhead_cmd = (
        serve["command"],
        overhead["command"].replace("python bench/overhead.py", "python -m bench overhead"),
    )
    return {
        "per_token_s": {
            "value": round(per_token, 7),
            "from": f"{cold:.3f} s a request over a new document (distinct, one replica) less its questions' share, "
            f"over {EVIDENCE_TOKENS + QUESTIONS * QUESTION_TOKENS} computed tokens",
            "command": f"{serve_cmd} ({serve['measured_at']}, {serve['hardware']})",
        },
        "per_cached_token_s": {
            "value": round(per_cached, 9),
            "from": f"{warm:.3f} s a re-ask of a kept document (re-ask less the first asks, one replica) less its "
            f"questions' tokens and share, over {QUESTIONS * EVIDENCE_TOKENS} cached tokens",
            "command": f"{serve_cmd} ({serve['measured_at']}, {serve['hardware']})",
        },
        "per_question_s": {
            "value": round(per_question, 4),
            "from": "one short question's decide() at the defaults (110 prompt tokens)",
            "command": f"{overhead_cmd} ({overhead['hardware']}, {overhead['threads']} thread)",
        },
        "two_replica_speed": {
            "value": round(sum(speeds) / len(speeds), 3),
            "from": "distinct workload, pow2 and evidence: the busier replica's requests at one replica's pace over "
            "the wall time",
            "command": f"{serve_cmd} ({serve['measured_at']}, {serve['hardware']})",
        },
    }


@dataclasses.dataclass(frozen=True)
class Cost:
    """Service seconds of a request from its tokens."""

    per_token: float
    per_cached: float
    per_question: float

    @classmethod
    def of(cls, fitted: dict) -> Cost:
        """From fitted_cost()."""
        return cls(
            fitted["per_token_s"]["value"], fitted["per_cached_token_s"]["value"], fitted["per_question_s"]["value"]
        )

    def seconds(self, cached: bool) -> float:
        """One request of QUESTIONS questions over a document its replica holds (`cached`) or not."""
        computed = QUESTIONS * QUESTION_TOKENS + (0 if cached else EVIDENCE_TOKENS)
        kept = QUESTIONS * EVIDENCE_TOKENS if cached else 0
        return self.per_token * computed + self.per_cached * kept + self.per_question * QUESTIONS


def kept_tokens(held: bool) -> int:
    """A request's prompt tokens read from prefixes its replica kept before its run began (`held`: the document):
    what a serve.json without `cached_counts` counted as cached, every question's evidence."""
    return QUESTIONS * EVIDENCE_TOKENS if held else 0


def tokens(cached: bool) -> tuple[int, int]:
    """(prompt tokens, of them not computed for it) of one request, as a replica's meta counts them: over a document
    its replica holds, or that another request of its run computes (`cached`), every question reads the evidence;
    else the first question computes it and the others read it."""
    return QUESTIONS * (EVIDENCE_TOKENS + QUESTION_TOKENS), (QUESTIONS if cached else QUESTIONS - 1) * EVIDENCE_TOKENS


# ---------------------------------------------------------------------------------------------------------------
# Routers
# ---------------------------------------------------------------------------------------------------------------


class EvidenceArm:
    """adapters.serve.EvidencePicker under one of its rules."""

    def __init__(self, settings: RouteSettings, rng: random.Random):
        self.picker = EvidencePicker(settings)

    def choose(self, ticket: str, doc: str, live: list[str]) -> str:
        """The picker's replica for a request over `doc`."""
        return self.picker.pick(doc, Price(EVIDENCE_TOKENS, QUESTIONS * QUESTION_TOKENS), live, ticket)

    def sent(self, ticket: str, replica: str) -> None:
        """The request went to `replica`."""
        self.picker.routed(ticket, replica)

    def done(self, ticket: str, replica: str) -> None:
        """The request came back."""
        self.picker.done(ticket)


class Pow2Arm:
    """Serve's power of two choices over requests in flight."""

    def __init__(self, settings: RouteSettings, rng: random.Random):
        self.rng, self.in_flight = rng, collections.Counter()

    def choose(self, ticket: str, doc: str, live: list[str]) -> str:
        """Two at random, the one with fewer in flight."""
        two = self.rng.sample(live, min(2, len(live)))
        least = min(self.in_flight[r] for r in two)
        return self.rng.choice([r for r in two if self.in_flight[r] == least])

    def sent(self, ticket: str, replica: str) -> None:
        """One more in flight."""
        self.in_flight[replica] += 1

    def done(self, ticket: str, replica: str) -> None:
        """One fewer in flight."""
        self.in_flight[replica] -= 1


class PrefixTreeArm(Pow2Arm):
    """PrefixCacheAffinityRouter: the replicas whose tree holds the document, else those with the smallest trees;
    the fewest in flight of them. `local`: Serve's locality rule's candidates (the ingress node's replicas)."""

    def __init__(self, settings: RouteSettings, rng: random.Random, local: list[str] | None = None):
        super().__init__(settings, rng)
        self.trees: dict[str, collections.OrderedDict] = collections.defaultdict(collections.OrderedDict)
        self.local = local

    def choose(self, ticket: str, doc: str, live: list[str]) -> str:
        """As the router's _prefix_match_best_replicas, then the shortest queue."""
        candidates = [r for r in live if r in self.local] if self.local else live
        candidates = [r for r in candidates if self.in_flight[r] < MAX_ONGOING] or live
        holding = [r for r in candidates if doc in self.trees[r]]
        if not holding:
            smallest = min(len(self.trees[r]) for r in candidates)
            holding = [r for r in candidates if len(self.trees[r]) == smallest]
        least = min(self.in_flight[r] for r in holding)
        return self.rng.choice([r for r in holding if self.in_flight[r] == least])

    def sent(self, ticket: str, replica: str) -> None:
        """The request's text enters the replica's tree (on_request_routed), the least recent evicted past the bound."""
        super().sent(ticket, replica)
        tree = self.trees[replica]
        tree[ticket.split("#")[0]] = True
        tree.move_to_end(ticket.split("#")[0])
        while len(tree) > PREFIX_TREE_DOCUMENTS:
            tree.popitem(last=False)


def router(arm: str, rng: random.Random, lead: int = 4, local: list[str] | None = None):
    """The arm's router."""
    if arm == "evidence":
        return EvidenceArm(RouteSettings(), rng)
    if arm == "evidence_lead":
        return EvidenceArm(RouteSettings(rule="lead", max_lead=lead), rng)
    if arm == "pow2":
        return Pow2Arm(RouteSettings(), rng)
    return PrefixTreeArm(RouteSettings(), rng, local)


# ---------------------------------------------------------------------------------------------------------------
# The simulation
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Replica:
    """One replica: its queue, what it is answering, its prefix cache and the seconds it worked."""

    name: str
    queue: collections.deque = dataclasses.field(default_factory=collections.deque)
    busy: bool = False
    cache: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)
    worked_s: float = 0.0
    answered: int = 0


class Sim:
    """Replicas, a router and a clock: requests arrive (at given times, or from closed-loop clients), are routed,
    queue, are answered one at a time per replica."""

    def __init__(self, names: list[str], route, cost: Cost, speed: float = 1.0):
        self.replicas = {n: Replica(n) for n in names}
        self.live = list(names)
        self.route, self.cost, self.speed = route, cost, speed
        self.events: list = []
        self.seq = 0
        self.now = 0.0
        self.done: list[dict] = []  # per answered request: doc, arrival, finish, replica, tokens, cached
        self.next_of_client = None  # closed loop: called when a client's request is answered
        self.membership = None  # called after a replica leaves or joins: (event, replica)
        self.asked: set[str] = set()  # the documents asked so far

    def at(self, t: float, kind: str, payload) -> None:
        """An event at time t."""
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def arrive(self, request: dict) -> None:
        """A request is routed and queued."""
        ticket = f"{request['doc']}#{request['n']}"
        self.asked.add(request["doc"])
        name = self.route.choose(ticket, request["doc"], list(self.live))
        self.route.sent(ticket, name)
        request["ticket"], request["replica"] = ticket, name
        replica = self.replicas[name]
        replica.queue.append(request)
        if not replica.busy:
            self.start(replica)

    def start(self, replica: Replica) -> None:
        """The replica takes every request waiting (up to MAX_ONGOING) into one run, as blink's Batcher does: a request
        reads its evidence from the cache when the cache held it as the run began, or from the prefix that the first
        request of the run over the same document computes (the engine groups prompts by their evidence's ids), and
        every answer of the run comes back at its end."""
        batch = [replica.queue.popleft() for _ in range(min(MAX_ONGOING, len(replica.queue)))]
        seconds, packed = 0.0, set()
        for request in batch:
            request["held"] = request["doc"] in replica.cache
            request["packed_read"] = not request["held"] and request["doc"] in packed
            request["cached"] = request["held"] or request["packed_read"]
            packed.add(request["doc"])
            seconds += self.cost.seconds(request["cached"]) / self.speed
        replica.busy = True
        replica.worked_s += seconds
        self.at(self.now + seconds, "finish", (replica.name, batch))

    def finish(self, name: str, batch: list[dict]) -> None:
        """The replica answered a run: its cache keeps the documents; the next run starts."""
        replica = self.replicas[name]
        replica.busy = False
        for request in batch:
            replica.answered += 1
            replica.cache[request["doc"]] = True
            replica.cache.move_to_end(request["doc"])
            while len(replica.cache) > PREFIX_CACHE_DOCUMENTS:
                replica.cache.popitem(last=False)
            self.route.done(request["ticket"], name)
            request["finished"] = self.now
            self.done.append(request)
        if replica.queue:
            self.start(replica)
        if self.next_of_client is not None:
            for request in batch:
                self.next_of_client(request)

    def run(self) -> None:
        """Every event, in time order."""
        while self.events:
            self.now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self.arrive(payload)
            elif kind == "finish":
                self.finish(*payload)
            elif kind == "leave":
                self.live.remove(payload)  # it answers what it holds (Serve drains a replica it stops)
            elif kind == "join":
                self.replicas[payload] = Replica(payload)
                self.live.append(payload)
            if kind in ("leave", "join") and self.membership is not None:
                self.membership(kind, payload)


def closed_loop(sim: Sim, docs: list[str], clients: int) -> dict:
    """`docs` asked in order by `clients` clients, each sending its next when its last is answered (as bench/serve.py's
    thread pool does): the wall time and the answered requests."""
    pending = collections.deque(enumerate(docs))
    start, first = sim.now, len(sim.done)

    def send(_answered=None) -> None:
        if pending:
            n, doc = pending.popleft()
            sim.at(sim.now, "arrive", {"doc": doc, "n": n, "arrived": sim.now})

    sim.next_of_client = send
    for _ in range(min(clients, len(docs))):
        send()
    sim.run()
    sim.next_of_client = None
    answered = sim.done[first:]
    return {"wall_s": max(r["finished"] for r in answered) - start, "answered": answered}


def summary(answered: list[dict], wall_s: float) -> dict:
    """req/s, latency, cached share and requests per replica of a run's answered requests."""
    latency = [r["finished"] - r["arrived"] for r in answered]
    inputs = sum(tokens(r["cached"])[0] for r in answered)
    cached = sum(tokens(r["cached"])[1] for r in answered)
    kept = sum(kept_tokens(r["held"]) for r in answered)
    by_replica = collections.Counter(r["replica"] for r in answered)
    return {
        "requests": len(answered),
        "req_per_s": round(len(answered) / wall_s, 4),
        "p50_s": round(harness.percentile(latency, 50), 3),
        "p99_s": round(harness.percentile(latency, 99), 3),
        "cached_share": round(cached / inputs, 4),
        "kept_share": round(kept / inputs, 4),
        "packed_reads": round(sum(r["packed_read"] for r in answered) / len(answered), 4),
        "by_replica": sorted(by_replica.values(), reverse=True),
    }


# ---------------------------------------------------------------------------------------------------------------
# The check against serve.json's two-node runs
# ---------------------------------------------------------------------------------------------------------------


def serve_workloads(cfg: dict) -> list[tuple[str, list[str], int]]:
    """bench/serve.py's workloads in its order, as document names: (workload, docs in send order, clients)."""
    out = []
    for name, (requests, clients) in workloads.serving_workloads({**cfg, "words": 1}).items():
        out.append((name, [f"doc{n}" for n, _, _ in requests], clients))
    return out


def matching_ids(seed_from: int, docs: list[str], split: list[int]) -> list[str]:
    """Two replica ids (drawn from seeds counting up from `seed_from`) whose rendezvous homes split `docs` as
    `split` (documents per replica, largest first)."""
    for seed in range(seed_from, seed_from + 10_000):
        ids = [f"replica-{seed}-{i}" for i in range(2)]
        homes = collections.Counter(ranked(d, ids)[0] for d in docs)
        if sorted([homes[i] for i in ids], reverse=True) == split:
            return ids
    raise RuntimeError(f"no two replica ids split {len(docs)} documents as {split}")


def replay(arm: str, cfg: dict, cost: Cost, speed: float, seed: int, lead: int | None, split: list[int] | None):
    """serve.json's run of one arm replayed: warm-up, then each workload in order on the same replicas."""
    rng = random.Random(seed)
    work = serve_workloads(cfg)
    if arm == "one_replica":
        ids, route, speed = ["replica-0"], Pow2Arm(RouteSettings(), rng), 1.0
    else:
        reask_docs = sorted(set(work[0][1]))
        ids = matching_ids(seed * 10_000, reask_docs, split) if split else [f"replica-{seed}-{i}" for i in range(2)]
        route = router(arm, rng, lead=lead or 4, local=ids[:1])
    sim = Sim(ids, route, cost, speed)
    for n, name in enumerate(ids):  # the warm-up: a document of each replica's own
        sim.replicas[name].cache[f"warm{n}"] = True
    out = {}
    for workload, docs, clients in work:
        ran = closed_loop(sim, docs, clients)
        out[workload] = summary(ran["answered"], ran["wall_s"])
    return out


def check(serve: dict, cost: Cost, speed: float, seeds: int = 20) -> list[dict]:
    """Each committed two-replica row of serve.json against the simulation: the evidence arms on replica ids whose
    hash split the re-ask documents as the committed run's did (the draw the run had), pow2 and prefix_tree over
    `seeds` draws (their own randomness) averaged. A serve.json without `cached_counts` counted as cached only what
    prefixes kept by earlier requests served (kept_share); the simulation's share is compared with what it counted."""
    share = "cached_share" if serve.get("cached_counts") else "kept_share"
    rows = []
    for real in serve["rows"]:
        arm = real["arm"]
        lead = real.get("lead", serve["default_lead"]) if arm.startswith("evidence") else None
        sim_arm = {"evidence": "evidence_lead", "evidence_lead": "evidence_lead"}.get(arm, arm)
        split = None
        if sim_arm == "evidence_lead":
            reask = next(
                r
                for r in serve["rows"]
                if r["workload"] == "reask" and r["arm"] == arm and r.get("lead") == real.get("lead")
            )
            asks = serve["config"]["asks"]
            split = [n // asks for n in reask["by_replica"]] if reask["documents_split"] == 0 else None
        draws = 1 if split or arm == "one_replica" else seeds
        runs = [replay(sim_arm, serve["config"], cost, speed, s, lead, split)[real["workload"]] for s in range(draws)]
        sim = {k: round(sum(r[k] for r in runs) / len(runs), 4) for k in ("req_per_s", share, "p50_s", "p99_s")}
        sim["cached_share"] = sim.pop(share)
        rows.append(
            {
                "workload": real["workload"],
                "arm": arm,
                **({"lead": real["lead"]} if "lead" in real else {}),
                "draws": draws,
                "homes_as_run": split is not None,
                "real": {k: real[k] for k in ("req_per_s", "cached_share", "p50_s", "p99_s", "by_replica")},
                "sim": {**sim, "by_replica": runs[0]["by_replica"]},
                "req_per_s_ratio": round(sim["req_per_s"] / real["req_per_s"], 3),
                "cached_share_gap": round(sim["cached_share"] - real["cached_share"], 4),
                "compared": share,
            }
        )
    return rows


def predicted(serve: dict, cost: Cost, speed: float, seeds: int) -> list[dict]:
    """serve.json's targets for the default rule (bounded) on its workloads, every arm averaged over `seeds` draws of
    replica ids: what `python -m bench serve` should find at the defaults, by the model."""
    means = {}
    for arm in ("one_replica", "pow2", "prefix_tree", "evidence"):
        runs = [replay(arm, serve["config"], cost, speed, s, None, None) for s in range(seeds)]
        means[arm] = {
            w: {k: sum(r[w][k] for r in runs) / len(runs) for k in ("req_per_s", "cached_share", "p99_s")}
            for w in runs[0]
        }
    ev, gap = (
        means["evidence"],
        means["one_replica"]["reask"]["cached_share"] - means["evidence"]["reask"]["cached_share"],
    )
    out = [
        {"target": "re-ask cached share within 5 points of one replica's", "value": round(gap, 4), "met": gap <= 0.05}
    ]
    for peer, times in (("pow2", 1.3), ("prefix_tree", 1.2), ("one_replica", 1.6)):
        ratio = ev["reask"]["req_per_s"] / means[peer]["reask"]["req_per_s"]
        out.append(
            {"target": f"re-ask req/s at least {times}x {peer}'s", "value": round(ratio, 3), "met": ratio >= times}
        )
    if "hot" in ev:  # a serve.json run without the hot workload has no hot target
        ratio = ev["hot"]["p99_s"] / means["pow2"]["hot"]["p99_s"]
        out.append({"target": "hot p99 at most 1.2x pow2's", "value": round(ratio, 3), "met": ratio <= 1.2})
    return out


# ---------------------------------------------------------------------------------------------------------------
# The grid: 4 to 256 replicas
# ---------------------------------------------------------------------------------------------------------------


def zipf_docs(rng: random.Random, docs: int, s: float, count: int) -> list[str]:
    """`count` documents drawn from `docs` by Zipf popularity of exponent s (document 0 the most asked)."""
    weights = [1 / (k + 1) ** s for k in range(docs)]
    return [f"doc{k}" for k in rng.choices(range(docs), weights=weights, k=count)]


def ideal_share(sequence: list[str]) -> float:
    """The cached share one replica with an unbounded cache would have: every ask after a document's first."""
    seen, inputs, cached = set(), 0, 0
    for doc in sequence:
        t = tokens(doc in seen)
        inputs, cached = inputs + t[0], cached + t[1]
        seen.add(doc)
    return cached / inputs


def grid_run(arm: str, replicas: int, s: float, load: float, cost: Cost, seed: int) -> dict:
    """One cell: Poisson arrivals at `load` of capacity, Zipf(s) documents, a replica leaving at a third of the way and
    one joining at two thirds."""
    rng = random.Random(seed)
    count = ASKS_PER_REPLICA * replicas
    sequence = zipf_docs(rng, 10 * replicas, s, count)
    ideal = ideal_share(sequence)
    first_asks = len(set(sequence))
    mean_s = (first_asks * cost.seconds(False) + (count - first_asks) * cost.seconds(True)) / count
    rate = load * replicas / mean_s
    ids = [f"replica-{seed}-{i}" for i in range(replicas)]
    sim = Sim(ids, router(arm, random.Random(seed + 1)), cost)
    t = 0.0
    for n, doc in enumerate(sequence):
        t += rng.expovariate(rate)
        sim.at(t, "arrive", {"doc": doc, "n": n, "arrived": t})
    leaver, joiner = ids[replicas // 2], f"replica-{seed}-joined"
    sim.at(t / 3, "leave", leaver)  # a replica leaves a third of the way through the arrivals, another joins at two
    sim.at(2 * t / 3, "join", joiner)
    moved = {}

    def membership(kind: str, name: str) -> None:
        """The documents the event moved, against the leaver's or joiner's share of the documents asked so far."""
        asked = sorted(sim.asked)
        share = len(asked) / (len(sim.live) + (1 if kind == "leave" else 0))
        picker = getattr(sim.route, "picker", None)
        if picker is None:
            return
        if picker.settings.rule == "bounded":
            before = picker.moved
            picker.update(list(sim.live))
            count = picker.moved - before
        else:  # rule lead keeps no homes: the documents whose rendezvous home changed
            old = [r for r in sim.live if r != name] + ([name] if kind == "leave" else [])
            count = sum(ranked(d, old)[0] != ranked(d, sim.live)[0] for d in asked)
        moved[kind] = {"documents": count, "share": round(share, 1), "ratio": round(count / share, 2)}

    sim.membership = membership
    sim.run()
    answered = sim.done
    wall = max(r["finished"] for r in answered) - min(r["arrived"] for r in answered)
    worked = [r.worked_s for r in sim.replicas.values()]
    out = {
        "arm": arm,
        "replicas": replicas,
        "zipf_s": s,
        "load": load,
        **summary(answered, wall),
        "ideal_cached_share": round(ideal, 4),
        "max_over_mean_work": round(max(worked) / (sum(worked) / len(worked)), 3),
        "documents": 10 * replicas,
        "documents_asked": first_asks,
    }
    out.pop("by_replica")
    if moved:
        out["moved"] = moved
    return out


def grid(sizes: tuple[int, ...], cost: Cost, seed: int = 1) -> list[dict]:
    """Every arm at every size, skew and load."""
    rows = []
    for replicas in sizes:
        for s in ZIPF:
            for load in LOADS:
                for arm in ARMS:
                    rows.append(grid_run(arm, replicas, s, load, cost, seed))
        print(f"{replicas} replicas done", flush=True)
    return rows


def targets(rows: list[dict]) -> list[dict]:
    """The simulation's routing targets: at every size and load, evidence's cached share within 5 points of the
    ideal and its p99 at or under pow2's; a join or a leave moving at most 1.5x the joiner's or leaver's share."""
    at = {(r["arm"], r["replicas"], r["zipf_s"], r["load"]): r for r in rows}
    cells = sorted({k[1:] for k in at})
    gaps = [at[("evidence", *c)]["ideal_cached_share"] - at[("evidence", *c)]["cached_share"] for c in cells]
    p99 = [at[("evidence", *c)]["p99_s"] / at[("pow2", *c)]["p99_s"] for c in cells]
    moves = [m["ratio"] for c in cells for m in at[("evidence", *c)].get("moved", {}).values()]
    return [
        {
            "target": "cached share within 5 points of the ideal, every cell",
            "value": round(max(gaps), 4),
            "met": max(gaps) <= 0.05,
        },
        {"target": "p99 at or under pow2's, every cell", "value": round(max(p99), 3), "met": max(p99) <= 1.0},
        {"target": "a join or leave moves at most 1.5x its share", "value": max(moves), "met": max(moves) <= 1.5},
    ]


def plot(rows: list[dict], replicas: int, path: str) -> None:
    """Four panels for one size: cached share (the ideal as a line), p99, req/s and the busiest replica's work over
    the mean, per arm over skew x load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r["replicas"] == replicas]
    cells = sorted({(r["zipf_s"], r["load"]) for r in mine})
    at = {(r["arm"], r["zipf_s"], r["load"]): r for r in mine}
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    width = 0.8 / len(ARMS)
    panels = (
        ("cached_share", "cached share of prompt tokens (black: one replica, unbounded cache)", False),
        ("p99_s", "p99 latency (s, log)", True),
        ("req_per_s", "requests per second", False),
        ("max_over_mean_work", "busiest replica's work over the mean", False),
    )
    for ax, (field, title, log) in zip(axes.flat, panels):
        for j, arm in enumerate(ARMS):
            xs = [i + (j - (len(ARMS) - 1) / 2) * width for i in range(len(cells))]
            ax.bar(xs, [at[(arm, *c)][field] for c in cells], width, label=arm)
        if field == "cached_share":
            for i, c in enumerate(cells):
                ax.hlines(at[("evidence", *c)]["ideal_cached_share"], i - 0.45, i + 0.45, color="black")
        ax.set_xticks(range(len(cells)), [f"s={s}\n{load:.0%}" for s, load in cells], fontsize=8)
        ax.set_title(title, fontsize=9)
        if log:
            ax.set_yscale("log")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"route_sim: {replicas} replicas, {10 * replicas} documents, one leaving and one joining mid-run")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def flags(ap) -> None:
    """route_sim's own flags."""
    ap.add_argument("--seeds", type=int, default=20, help="draws averaged for the randomised arms in the check")


def main(argv: list[str] | None = None) -> int:
    """The check against serve.json, then the grid; tables printed, bench/results/route_sim.json and a PNG per size."""
    run = harness.Run("route_sim", argv, __doc__, flags)
    with open(SERVE_JSON, encoding="utf-8") as fh:
        serve = json.load(fh)
    with open(os.path.join(harness.RESULTS, "overhead.json"), encoding="utf-8") as fh:
        overhead = json.load(fh)
    fitted = fitted_cost(serve, overhead)
    cost, speed = Cost.of(fitted), fitted["two_replica_speed"]["value"]
    checked = check(serve, cost, speed, run.args.seeds)
    foreseen = predicted(serve, cost, speed, run.args.seeds)
    sizes = SIZES["quick" if run.quick else "full"]
    rows = grid(sizes, cost)
    result = {
        "cost_model": fitted,
        "settings": dataclasses.asdict(RouteSettings()),
        "prefix_cache_documents": PREFIX_CACHE_DOCUMENTS,
        "prefix_tree_documents": PREFIX_TREE_DOCUMENTS,
        "asks_per_replica": ASKS_PER_REPLICA,
        "check": checked,
        "predicted": foreseen,
        "rows": rows,
        "targets": targets(rows),
    }
    path = run.write(result)
    for replicas in sizes:
        plot(rows, replicas, path.removesuffix(".json") + f"-{replicas}.png")
    print("\n".join(route_sim_report(run.written)))
    return 0


def route_sim_report(res: dict) -> list[str]:
    """The cost model, the check against serve.json, each size's grid, then the targets."""
    costs = [[name, p["value"], p["from"], f"`{p['command']}`"] for name, p in res["cost_model"].items()]
    lines = ["Cost model (seconds):", "", *report.table(["parameter", "value", "from", "measured by"], costs)]
    checks = [
        [r["workload"], r["arm"] + (f" lead {r['lead']}" if "lead" in r else ""), r["draws"]]
        + ["yes" if r["homes_as_run"] else "no", f"{r['sim']['req_per_s']:.3f} / {r['real']['req_per_s']:.3f}"]
        + [f"{r['req_per_s_ratio']:.2f}", f"{r['sim']['cached_share']:.1%} / {r['real']['cached_share']:.1%}"]
        + [f"{r['sim']['p99_s']:.1f} / {r['real']['p99_s']:.1f}"]
        for r in res["check"]
    ]
    lines += [
        "",
        "Against serve.json's two-node runs (sim / committed; draws: replica-id draws averaged; homes as run: the "
        "ids drawn so the re-ask documents' rendezvous homes split as in the committed run"
        + (
            "; the share a run counted as cached: serve.json predates per-request counts, so only prefixes kept by "
            "earlier requests):"
            if any(r.get("compared") == "kept_share" for r in res["check"])
            else "):"
        ),
        "",
        *report.table(
            ["workload", "arm", "draws", "homes as run", "req/s sim / real", "ratio", "cached share sim / real"]
            + ["p99 s sim / real"],
            checks,
        ),
    ]
    if res.get("predicted"):
        lines += ["", "serve.json's workloads under the default (bounded) evidence rule, predicted:", ""]
        lines += [f"- {t['target']}: {t['value']} ({'met' if t['met'] else 'MISSED'})" for t in res["predicted"]]
    head = ["zipf s", "load", "arm", "req/s", "p50 s", "p99 s", "cached share / ideal", "read in the run"]
    head += ["max/mean work", "moved by leave, join"]
    for replicas in sorted({r["replicas"] for r in res["rows"]}):
        rows = []
        for r in (r for r in res["rows"] if r["replicas"] == replicas):
            moved = r.get("moved")
            shown = ", ".join(f"{m['documents']} ({m['ratio']:.2f}x share)" for m in moved.values()) if moved else "—"
            rows.append(
                [r["zipf_s"], f"{r['load']:.0%}", r["arm"], f"{r['req_per_s']:.2f}", f"{r['p50_s']:.1f}"]
                + [f"{r['p99_s']:.1f}", f"{r['cached_share']:.1%} / {r['ideal_cached_share']:.1%}"]
                + [f"{r['packed_reads']:.1%}", f"{r['max_over_mean_work']:.2f}", shown]
            )
        lines += [
            "",
            f"{replicas} replicas, {10 * replicas} documents, {res['asks_per_replica'] * replicas} requests:",
            "",
            *report.table(head, rows),
        ]
    lines += ["", *(f"- {t['target']}: {t['value']} ({'met' if t['met'] else 'MISSED'})" for t in res["targets"])]
    return lines


REPORT = (route_sim_report, ("cost_model", "check", "predicted", "rows", "targets", "asks_per_replica"))
