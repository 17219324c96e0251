"""Serving past one machine: blink on Ray Serve (adapters/serve.py) on a local cluster of two Ray nodes, one replica
against two under each routing policy, over HTTP with concurrent clients.

    python bench/serve.py            # documents of ~3,000 tokens (about 20 minutes on a 2-core CPU)
    python bench/serve.py --quick    # documents of ~400 tokens, fewer of them (a few minutes)

The cluster: two Ray nodes of one CPU each on this machine (Ray's ray.cluster_utils.Cluster), a replica holding one
CPU (one torch thread), blink at its defaults (no BLINK_* variable read). Arms, each a fresh deployment of the app
(replicas start with empty prefix caches), in this order: one replica; two replicas under `pow2` (Serve's default
router), `prefix_tree` (Ray Serve LLM's PrefixCacheAffinityRouter) and `evidence` (blink's: each document's home by
rendezvous hashing of its evidence key, the least loaded past BLINK_ROUTE_MAX_LEAD); then `evidence` at other
thresholds (--leads), on the hot workload only. Workloads, each over documents of its own (no arm sees a document
another workload of it saw), every request a System One call of two questions:

- reask: D documents x Q asks each, interleaved (every document's first ask, then every second ask, ...), from C
  concurrent clients. Every ask about a document asks questions no other ask asked, so no request repeats another:
  what a replica can reuse is the document's prefix in its cache, not a whole answer.
- distinct: D documents asked once each (nothing to reuse: routing can only spread the load).
- hot: one hot document asked by half the requests (each with new questions), the other half new documents, from C
  clients: the load fallback at work.

Per arm and workload: requests per second (requests over the wall time from the first request sent to the last
answer), p50 and p99 latency, the cached share of prompt tokens (the answers' cached_tokens over input_tokens), how
the requests split over the replicas, and each document's replicas. After every arm, the same requests are answered
in this process by blink at the same settings (decide(), one at a time), and each arm's largest probability gap from
those answers is reported. Writes bench/results/serve.json (serve-quick.json for --quick); prints the table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import logging
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import blink  # noqa: E402
from adapters.serve import RouteSettings  # noqa: E402

APP = "blink"
WORDS = (
    "the customer wrote again about a refund for the annual plan and asked whether the invoice could be split across "
    "two cost centres because the finance team closes its books on friday while the card on file expired last month "
    "and the admin who set up single sign on left the company so nobody can reach the billing page or change the "
    "owner of the workspace before the renewal date which falls on the first of next month"
).split()
TOPICS = (
    "a refund",
    "the invoice",
    "single sign on",
    "the renewal date",
    "the card on file",
    "the finance team",
    "a cost centre",
    "the workspace owner",
    "the billing page",
    "the annual plan",
    "an admin leaving",
    "a deadline",
)


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def document(n: int, words: int) -> str:
    """Document n: a support log of `words` words, distinct for every n."""
    lines, i = [], 0
    while i < words:
        lines.append(f"[{n}.{len(lines)}] " + " ".join(WORDS[(n * 13 + i + k) % len(WORDS)] for k in range(24)))
        i += 24
    return f"Support log {n}\n" + "\n".join(lines)


def questions(ask: int) -> dict:
    """The two questions of ask number `ask` about a document: a yes/no and a three-way choice, worded for this ask
    alone (no two asks send the same questions)."""
    topic, nth = TOPICS[ask % len(TOPICS)], ask // len(TOPICS)
    return {
        "mentions": {"type": "noul", "instructions": f"Does the log mention {topic}? (check {nth})"},
        "team": {
            "type": "choice",
            "instructions": f"Which team owns what the log says about {topic}? (review {nth})",
            "criteria": {"billing": "payments and invoices", "access": "logins and admins", "other": None},
        },
    }


def reask(first: int, docs: int, asks: int, words: int) -> list[tuple[int, str, dict]]:
    """(document, state, questions) of `docs` documents x `asks` asks, interleaved."""
    return [(first + d, document(first + d, words), questions(a)) for a in range(asks) for d in range(docs)]


def distinct(first: int, docs: int, words: int) -> list[tuple[int, str, dict]]:
    """`docs` documents asked once each."""
    return [(first + d, document(first + d, words), questions(0)) for d in range(docs)]


def hot(first: int, requests: int, words: int) -> list[tuple[int, str, dict]]:
    """`requests` requests, every other one about one hot document (new questions each time), the rest about new
    documents."""
    out = []
    for i in range(requests):
        n = first if i % 2 == 0 else first + 1 + i // 2
        out.append((n, document(n, words), questions(i)))
    return out


@contextlib.contextmanager
def two_nodes() -> Iterator[object]:
    """A local Ray cluster of two nodes with one CPU each (Ray's ray.cluster_utils.Cluster), this process its driver
    (the repository shipped as the working directory), Serve's proxy on a free loopback port; yields the app's URL.
    Everything it started is stopped at the end."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    temp = tempfile.mkdtemp(prefix="blink-serve-bench-", dir="/tmp")  # Ray's socket paths must fit 107 characters
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["RAY_memory_monitor_refresh_ms"] = "0"  # other programs must not get this cluster's workers killed
    nodes = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "gcs_server_port": free_port(), "include_dashboard": False, "temp_dir": temp},
    )
    nodes.add_node(num_cpus=1)
    try:
        ray.init(
            address=nodes.address,
            runtime_env={"working_dir": ROOT, "excludes": [".git", ".venv", ".venv-vllm", "bench/results", "tests"]},
            logging_level="ERROR",
            log_to_driver=False,
        )
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        yield f"http://127.0.0.1:{port}"
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        nodes.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


@contextlib.contextmanager
def deployed(args: dict, lead: int | None = None) -> Iterator[None]:
    """The app deployed with `args` (BLINK_ROUTE_MAX_LEAD=`lead` where given), deleted afterwards."""
    from ray import serve

    from adapters import serve as serve_app

    before = os.environ.get("BLINK_ROUTE_MAX_LEAD")
    if lead is not None:
        os.environ["BLINK_ROUTE_MAX_LEAD"] = str(lead)
    try:
        serve.run(serve_app.app(args), name=APP, route_prefix="/")
    finally:
        if before is None:
            os.environ.pop("BLINK_ROUTE_MAX_LEAD", None)
        else:
            os.environ["BLINK_ROUTE_MAX_LEAD"] = before
    try:
        yield
    finally:
        serve.delete(APP)


def ask(client, url: str, state: str, qs: dict) -> dict:
    """One System One request: its latency and reply (a refusal retried after its Retry-After, as the SDKs do)."""
    body = {"model": "jev-latest", "state": state, "questions": qs}
    started = time.perf_counter()
    while True:
        reply = client.post(url + "/v1/systemone", json=body, timeout=900)
        if reply.status_code != 503:
            break
        time.sleep(float(reply.headers.get("retry-after", 1)))
    if reply.status_code != 200:
        raise RuntimeError(f"{reply.status_code}: {reply.text[:300]}")
    return {"seconds": time.perf_counter() - started, "reply": reply.json()}


def drive(url: str, requests: list[tuple[int, str, dict]], clients: int) -> dict:
    """Every request, in order, taken by `clients` concurrent clients; returns the replies and the wall time."""
    import httpx

    with httpx.Client() as client, concurrent.futures.ThreadPoolExecutor(clients) as pool:
        started = time.perf_counter()
        done = list(pool.map(lambda r: ask(client, url, r[1], r[2]), requests))
        wall = time.perf_counter() - started
    return {"wall_s": wall, "done": done}


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) of the values, interpolated."""
    ordered = sorted(values)
    return statistics.quantiles(ordered, n=100, method="inclusive")[int(q) - 1] if len(ordered) > 1 else ordered[0]


def summary(requests: list[tuple[int, str, dict]], run: dict) -> dict:
    """Requests per second, latency, cached share, the split over replicas and how many documents more than one
    replica answered."""
    metas = [d["reply"]["x_meta"] for d in run["done"]]
    seconds = [d["seconds"] for d in run["done"]]
    by_doc: dict[int, set] = {}
    for (doc, _, _), meta in zip(requests, metas):
        by_doc.setdefault(doc, set()).add(meta["replica"])
    replicas = sorted({m["replica"] for m in metas})
    asked_often = [doc for doc in by_doc if sum(r[0] == doc for r in requests) > 1]
    return {
        "requests": len(requests),
        "wall_s": round(run["wall_s"], 2),
        "req_per_s": round(len(requests) / run["wall_s"], 3),
        "p50_s": round(percentile(seconds, 50), 3),
        "p99_s": round(percentile(seconds, 99), 3),
        "cached_share": round(
            sum(m.get("cached_tokens") or 0 for m in metas) / sum(m["input_tokens"] for m in metas), 4
        ),
        "by_replica": [sum(m["replica"] == r for m in metas) for r in replicas],
        "documents_split": sum(len(by_doc[doc]) > 1 for doc in asked_often),
        "documents_asked_again": len(asked_often),
    }


def probabilities(reply: dict) -> dict[str, list[float]]:
    """Each answer's probabilities, by question (noul: p(yes))."""
    out = {}
    for key, answer in reply["answers"].items():
        out[key] = [answer["noul"]] if "noul" in answer else list(answer["probabilities"].values())
    return out


def largest_gap(replies: list[dict], references: list[dict]) -> float:
    """The largest probability difference between the replies and the in-process answers to the same requests."""
    gap = 0.0
    for reply, want in zip(replies, references):
        for key, got in probabilities(reply).items():
            gap = max(gap, *(abs(a - b) for a, b in zip(got, want[key])))
    return gap


def in_process(requests: list[tuple[int, str, dict]]) -> list[dict]:
    """The same requests answered in this process, one at a time, by blink at its defaults, shaped as System One
    answers (probabilities by question)."""
    from adapters import wire

    deployment = blink.Deployment(blink.Settings.from_env({}))
    out = []
    for _, state, qs in requests:
        call = wire.systemone_call({"model": "jev-latest", "state": state, "questions": qs}, {}, deployment)
        out.append(probabilities(wire.systemone_response(call, deployment.decide(state, qs))))
    return out


ARMS = (
    ("one replica", {"replicas": 1}),
    ("pow2", {"replicas": 2, "routing": "pow2"}),
    ("prefix_tree", {"replicas": 2, "routing": "prefix_tree"}),
    ("evidence", {"replicas": 2, "routing": "evidence"}),
)


def table(results: dict) -> list[str]:
    """The markdown table: per workload and arm, req/s, latency, cached share, split and gap."""
    lines = [
        "| workload | arm | req/s | p50 s | p99 s | cached share | requests per replica | documents split | gap |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for workload, arms in results["workloads"].items():
        for arm, row in arms.items():
            split = f"{row['documents_split']}/{row['documents_asked_again']}" if row["documents_asked_again"] else "-"
            lines.append(
                f"| {workload} | {arm} | {row['req_per_s']:.3f} | {row['p50_s']:.2f} | {row['p99_s']:.2f} | "
                f"{row['cached_share']:.1%} | {'/'.join(map(str, row['by_replica']))} | {split} | "
                f"{row['largest_gap']:.1e} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the arms over the workloads on a local two-node cluster, print the table, write the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short documents, fewer of them")
    parser.add_argument(
        "--leads", default="0,2,4,8,16", help="BLINK_ROUTE_MAX_LEAD values for the hot workload (the default's skipped)"
    )
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    words, docs, asks, clients, hot_requests = (300, 4, 3, 4, 16) if args.quick else (2300, 6, 4, 4, 32)
    workloads = {
        "reask": (reask(100, docs, asks, words), clients),
        "distinct": (distinct(200, 2 * docs, words), clients),
        "hot": (hot(300, hot_requests, words), 2 * clients),
    }
    default_lead = RouteSettings().max_lead
    leads = [int(x) for x in args.leads.split(",") if x.strip() and int(x) != default_lead]
    logging.getLogger("httpx").setLevel(logging.WARNING)
    for name in [k for k in os.environ if k.startswith("BLINK_")]:  # blink at its defaults, in every process
        del os.environ[name]
    started = time.time()
    runs: dict[str, dict[str, tuple[list, dict]]] = {}
    with two_nodes() as url:
        for arm, app_args in ARMS + tuple(
            (f"evidence, lead {n}", {"replicas": 2, "routing": "evidence"}) for n in leads
        ):
            lead = int(arm.rsplit(" ", 1)[1]) if arm.startswith("evidence, lead") else None
            chosen = workloads if lead is None else {"hot": workloads["hot"]}
            with deployed(app_args, lead):
                for name, (requests, n_clients) in chosen.items():
                    runs.setdefault(name, {})[arm] = (requests, drive(url, requests, n_clients))
                    print(f"{name:9} {arm:20} {runs[name][arm][1]['wall_s']:.1f} s", flush=True)
    references = {name: in_process(requests) for name, (requests, _) in workloads.items()}
    results = {
        "command": "python bench/serve.py" + (" --quick" if args.quick else "") + f" --leads {args.leads}",
        "hardware": blink.hardware(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration_s": round(time.time() - started, 1),
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "cluster": "two Ray nodes of one CPU each on this machine (ray.cluster_utils.Cluster); one replica per CPU",
        "documents": {"words": words, "reask": [docs, asks], "distinct": 2 * docs, "hot_requests": hot_requests},
        "clients": {name: n for name, (_, n) in workloads.items()},
        "default_lead": default_lead,
        "dtype": next(iter(next(iter(runs.values())).values()))[1]["done"][0]["reply"]["x_meta"].get("dtype"),
        "workloads": {
            name: {
                arm: {
                    **summary(requests, run),
                    "largest_gap": largest_gap([d["reply"] for d in run["done"]], references[name]),
                }
                for arm, (requests, run) in arms.items()
            }
            for name, arms in runs.items()
        },
    }
    path = os.path.join(args.out, f"serve{'-quick' if args.quick else ''}.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1)
        fh.write("\n")
    print("\n".join(table(results)))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
