"""blink's Ray Serve app on a local two-node cluster: one replica against two under each router, over HTTP.

    python -m bench serve            # documents of ~3,400 tokens
    python -m bench serve --quick    # documents of ~540 tokens, fewer of them (5-8 minutes on a 2-core AMD EPYC)
    python -m bench serve --draws 2 --words 300 --workloads reask,hot --leads '' --name serve-default
                                     # the default router over two draws of replica ids (serve-default.json)

The cluster: two Ray nodes of one CPU each on this machine (bench/lib/servers.py ray_serve: Ray's ray.cluster_utils),
each replica holding one CPU and one torch thread, blink at its defaults (no BLINK_* variable read). The arms (the
registry's "serve" arms, bench/lib/arms.py), each a fresh deployment of adapters/serve.py's app, so every arm's replicas
start with empty caches (each replica first answers a warm-up request about a document of its own, so no workload
times a fresh process's first forwards): one replica; two replicas under `pow2` (Serve's default router),
`prefix_tree` (Ray Serve LLM's PrefixCacheAffinityRouter) and `evidence` (blink's, at its defaults: bounded loads);
then `evidence` under its earlier rule (BLINK_ROUTE_RULE=lead) at BLINK_ROUTE_MAX_LEAD values (--leads), on the
re-ask and hot workloads. The
workloads, every request a System One call of two questions over one document (~3,400 prompt tokens a question; ~540
with --quick), sent by C concurrent clients (8; 4 with --quick) over HTTP, each workload over documents no other
asks about:

- reask: D documents x Q asks each (8 x 4; 4 x 3), interleaved (every document's first ask, then every second, ...).
  Each ask asks questions no other ask asks, so no request repeats another: a replica's answer cache (exact repeats)
  never answers, and what routing can keep is the document's prefix in a replica's prefix cache.
- distinct: 2D documents asked once each: nothing to keep, routing can only spread the load.
- hot: one document asked by every other request (with new questions each time), new documents in between (32
  requests; 16), from twice the clients, so the hot document's home can hold more requests than BLINK_ROUTE_MAX_LEAD's
  default beyond the other replica: the load fallback at work.

Draws (--draws N): every arm is deployed N times, the arms taking turns (each arm's first deployment, then each
one's second, ...). Serve gives every deployment's replicas new random ids, and the ids are what `evidence`'s
rendezvous ranking hashes with each document's key, so each deployment draws the documents' homes anew (and `pow2`'s
and `prefix_tree`'s random choices); one draw's split of a handful of documents can decide a comparison, several show
the spread. --words sets the documents' length, --workloads which workloads run, --name the results file's name.

Per arm and workload: requests per second (the requests over the wall time from the first sent to the last answered),
p50 and p99 latency, the cached share of prompt tokens (the answers' cached_tokens over their input_tokens), the
requests each replica answered, and how many of the documents asked more than once more than one replica answered.
Then, with the cluster gone, every request is answered again in this process by blink at the same defaults (one at a
time), and each arm's answers are compared with those (bench/lib/answers.py). With several draws, the spread: each arm's
figures on each workload as min, median and max over its draws. The targets: under `evidence` the re-ask workload's
cached share within 5 points of one replica's, its req/s at least 1.3x `pow2`'s, 1.2x `prefix_tree`'s and 1.6x one
replica's; on the hot workload a p99 at most 1.2x `pow2`'s: each draw's arms against one another (they ran side by
side), and the median, min and max of those values over the draws.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import statistics
import time
from collections.abc import Iterator
from unittest import mock

import blink
from adapters import wire
from bench.lib import answers, arms, harness, report, servers
from bench.lib.workloads import FIRST_DOCUMENT, Request, serving_questions, serving_workloads, support_log

APP = "blink"
CONFIGS = {
    "full": {"words": 2300, "docs": 8, "asks": 4, "clients": 8, "hot_requests": 32},
    "quick": {"words": 300, "docs": 4, "asks": 3, "clients": 4, "hot_requests": 16},
}
CACHED_COUNTS = "not computed for the request"  # runs before this field counted only prefixes kept by earlier calls
WARM_UP = 900  # the warm-up's first document number


@contextlib.contextmanager
def deployed(app_args: dict, lead: int | None = None) -> Iterator[None]:
    """The Serve app deployed with `app_args` (its router under rule `lead` at BLINK_ROUTE_MAX_LEAD = `lead` where
    given: the app builder reads them here), deleted on leaving."""
    from ray import serve

    from adapters import serve as serve_app

    with mock.patch.dict(os.environ):  # the variables as the arm sets them, while the app builder reads them
        os.environ.pop("BLINK_ROUTE_MAX_LEAD", None)
        os.environ.pop("BLINK_ROUTE_RULE", None)
        if lead is not None:  # the earlier rule (lead), at this lead
            os.environ["BLINK_ROUTE_RULE"] = "lead"
            os.environ["BLINK_ROUTE_MAX_LEAD"] = str(lead)
        serve.run(serve_app.app(app_args), name=APP, route_prefix="/")
    try:
        yield
    finally:
        serve.delete(APP)


def ask(client, url: str, request: Request) -> tuple[float, dict]:
    """One System One request: (seconds to its answer, the reply). A 503 is asked again after its Retry-After, as the
    SDKs do; any other refusal stops the run."""
    body = {"model": "jev-latest", "state": request[1], "questions": request[2]}

    def answered():
        while True:
            reply = client.post(url + "/v1/systemone", json=body, timeout=1800)
            if reply.status_code != 503:
                return reply
            time.sleep(float(reply.headers.get("retry-after", 1)))  # as long as the server asks

    seconds, _, reply = harness.timed(answered)
    if reply.status_code != 200:
        raise SystemExit(f"the Serve app refused a request: {reply.status_code} {reply.text[:300]}")
    return seconds, reply.json()


def warm_up(url: str, replicas: int, words: int) -> int:
    """Ask about documents no workload asks about, one at a time, until each of the app's replicas has answered one
    (a fresh process's first forwards set up its kernels and memory); the requests it took."""
    import httpx

    with httpx.Client() as client:
        for n in range(1, 8 * replicas + 1):
            ask(client, url, (WARM_UP + n, support_log(WARM_UP + n, words), serving_questions(0)))
            rows = client.get(url + "/info", timeout=60).json()["replicas"]
            if sum(r["live"] and r["answered"] > 0 for r in rows) == replicas:
                return n
    raise SystemExit(f"the app's {replicas} replicas did not all answer {8 * replicas} warm-up requests")


def drive(url: str, requests: list[Request], clients: int) -> dict:
    """Every request, taken in order by `clients` concurrent clients: the wall time and each (seconds, reply)."""
    import httpx

    with httpx.Client() as client, concurrent.futures.ThreadPoolExecutor(clients) as pool:
        wall, _, done = harness.timed(lambda: list(pool.map(lambda r: ask(client, url, r), requests)))
    return {"wall_s": wall, "done": done}


def computed(meta: dict) -> int:
    """Prompt tokens a replica computed for one answer: its input tokens less those read from the prefix cache."""
    return meta["input_tokens"] - (meta.get("cached_tokens") or 0)


def row(workload: str, arm: str, requests: list[Request], run: dict) -> dict:
    """One arm on one workload: req/s, latency, cached share, the requests per replica and the documents split."""
    metas = [reply["x_meta"] for _, reply in run["done"]]
    seconds = [s for s, _ in run["done"]]
    replicas_of: dict[int, set] = {}
    for (doc, _, _), meta in zip(requests, metas):
        replicas_of.setdefault(doc, set()).add(meta["replica"])
    again = [doc for doc in replicas_of if sum(r[0] == doc for r in requests) > 1]
    replicas = sorted({m["replica"] for m in metas})
    return {
        "workload": workload,
        "arm": arm,
        "requests": len(requests),
        "wall_s": round(run["wall_s"], 2),
        "req_per_s": round(len(requests) / run["wall_s"], 3),
        "p50_s": round(harness.percentile(seconds, 50), 3),
        "p99_s": round(harness.percentile(seconds, 99), 3),
        "cached_share": round(
            sum(m.get("cached_tokens") or 0 for m in metas) / sum(m["input_tokens"] for m in metas), 4
        ),
        "by_replica": sorted((sum(m["replica"] == r for m in metas) for r in replicas), reverse=True),
        "replica_ids": replicas,
        # the prompt tokens each replica computed (not read from its cache), busiest first, and all of them over the
        # wall time: two replicas on free cores compute about twice one replica's tokens a second
        "computed_by_replica": sorted(
            (sum(computed(m) for m in metas if m["replica"] == r) for r in replicas), reverse=True
        ),
        "computed_per_s": round(sum(computed(m) for m in metas) / run["wall_s"], 1),
        "load_1m": round(
            os.getloadavg()[0], 2
        ),  # the machine's load as the workload ended (other work shares the cores)
        "documents_split": sum(len(replicas_of[doc]) > 1 for doc in again),
        "documents_asked_again": len(again),
    }


def in_process(requests: list[Request]) -> list[dict]:
    """The same requests answered one at a time in this process by blink at its defaults, shaped as System One
    answers."""
    deployment = blink.Deployment(blink.Settings.from_env({}))
    out = []
    for _, state, qs in requests:
        call = wire.systemone_call({"model": "jev-latest", "state": state, "questions": qs}, {}, deployment)
        out.append(wire.systemone_response(call, deployment.decide(state, qs))["answers"])
    return out


def targets(rows: list[dict]) -> list[dict]:
    """The targets on one draw's rows (the arms at the router's defaults), with the measured values."""
    at = {(r["workload"], r["arm"]): r for r in rows if "lead" not in r}
    reask = {arm: at[("reask", arm)] for arm in ("one_replica", "pow2", "prefix_tree", "evidence")}
    gap = reask["one_replica"]["cached_share"] - reask["evidence"]["cached_share"]
    out = [
        {"target": "re-ask cached share within 5 points of one replica's", "value": round(gap, 4), "met": gap <= 0.05},
    ]
    for peer, times in (("pow2", 1.3), ("prefix_tree", 1.2), ("one_replica", 1.6)):
        ratio = reask["evidence"]["req_per_s"] / reask[peer]["req_per_s"]
        out.append(
            {"target": f"re-ask req/s at least {times}x {peer}'s", "value": round(ratio, 3), "met": ratio >= times}
        )
    if ("hot", "evidence") in at and ("hot", "pow2") in at:
        ratio = at[("hot", "evidence")]["p99_s"] / at[("hot", "pow2")]["p99_s"]
        out.append({"target": "hot p99 at most 1.2x pow2's", "value": round(ratio, 3), "met": ratio <= 1.2})
    return out


def spread_of(values: list[float]) -> dict:
    """min, median and max of one figure over the draws."""
    return {"min": min(values), "median": round(statistics.median(values), 4), "max": max(values)}


def spread(rows: list[dict]) -> list[dict]:
    """Each arm's figures on each workload over its draws: min, median and max."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["arm"], r.get("lead")), []).append(r)
    out = []
    for (workload, arm, lead), runs in groups.items():
        out.append(
            {
                "workload": workload,
                "arm": arm,
                **({} if lead is None else {"lead": lead}),
                "draws": len(runs),
                **{k: spread_of([r[k] for r in runs]) for k in ("req_per_s", "p50_s", "p99_s", "cached_share")},
                "documents_split": [r["documents_split"] for r in runs],
                "documents_asked_again": runs[0]["documents_asked_again"],
            }
        )
    return out


def targets_over(by_draw: list[list[dict]]) -> list[dict]:
    """Each target over the draws: its value in each (the median the headline), met where every draw meets it."""
    out = []
    for i, first in enumerate(by_draw[0]):
        values = [draw[i]["value"] for draw in by_draw]
        met = [draw[i]["met"] for draw in by_draw]
        out.append(
            {
                "target": first["target"],
                "value": round(statistics.median(values), 4),
                "values": values,
                **{k: v for k, v in spread_of(values).items() if k != "median"},
                "met_in": sum(met),
                "met": all(met),
            }
        )
    return out


def flags(ap) -> None:
    """serve's own flags."""
    ap.add_argument("--clients", type=int, default=None, help="concurrent clients (8; quick 4; hot: twice as many)")
    ap.add_argument(
        "--leads", default="0,4,8", help="BLINK_ROUTE_MAX_LEAD values of rule lead for re-ask and hot (none: '')"
    )
    ap.add_argument("--draws", type=int, default=1, help="deployments of every arm, taking turns (default 1)")
    ap.add_argument("--words", type=int, default=None, help="words a document (2300; quick 300)")
    ap.add_argument("--workloads", default=None, help="the workloads to run, e.g. reask,hot (default: every one)")
    ap.add_argument("--name", default="serve", help="the results file's name (default serve: bench/results/serve.json)")


def main(argv: list[str] | None = None) -> int:
    """Run the arms over the workloads on a local two-node cluster, print the tables, write bench/results/serve.json."""
    run = harness.Run("serve", argv, __doc__, flags)
    given = {"clients": run.args.clients, "words": run.args.words}
    cfg = {**CONFIGS["quick" if run.quick else "full"], **{k: v for k, v in given.items() if v}}
    if run.args.workloads:
        cfg["workloads"] = [w.strip() for w in run.args.workloads.split(",") if w.strip()]
        unknown = sorted(set(cfg["workloads"]) - set(FIRST_DOCUMENT))
        if unknown or "reask" not in cfg["workloads"]:
            raise SystemExit(f"--workloads takes reask (always) and any of distinct, hot; not {unknown}")
    if run.args.draws < 1:
        raise SystemExit("--draws must be at least 1")
    from adapters.serve import RouteSettings

    default_lead = RouteSettings().max_lead
    leads = [int(x) for x in run.args.leads.split(",") if x.strip()]
    for name in [k for k in os.environ if k.startswith("BLINK_")]:  # blink at its defaults in every process
        del os.environ[name]
    logging.getLogger("httpx").setLevel(logging.WARNING)
    work = serving_workloads(cfg)
    registry = arms.of("serve")
    plan = [(name, arm.app_args, None, list(work)) for name, arm in registry.items() if name != "evidence_lead"]
    plan += [("evidence_lead", registry["evidence_lead"].app_args, lead, ["reask", "hot"]) for lead in leads]
    plan = [(name, app_args, lead, [w for w in names if w in work]) for name, app_args, lead, names in plan]
    run.probe()
    runs = []
    with servers.ray_serve(nodes=2, cpus=1) as url:
        for draw in range(1, run.args.draws + 1):  # the arms take turns: each draw's arms ran side by side
            for name, app_args, lead, names in plan:
                with deployed(app_args, lead):
                    warm_up(url, app_args["replicas"], cfg["words"])
                    for workload in names:
                        requests, clients = work[workload]
                        runs.append((draw, workload, name, lead, requests, drive(url, requests, clients)))
                        shown = "" if lead is None else lead
                        print(f"draw {draw} {workload:9} {name} {shown} {runs[-1][5]['wall_s']:.1f} s", flush=True)
    reference = {name: answers.flat(in_process(requests)) for name, (requests, _) in work.items()}
    rows = []
    for draw, workload, name, lead, requests, done in runs:
        rows.append(
            {
                **row(workload, name, requests, done),
                **({} if lead is None else {"lead": lead}),
                "draw": draw,
                "vs_in_process": answers.compare(
                    reference[workload], answers.flat([reply["answers"] for _, reply in done["done"]])
                ),
            }
        )
    first = runs[0][5]["done"][0][1]["x_meta"]
    by_draw = [targets([r for r in rows if r["draw"] == d]) for d in range(1, run.args.draws + 1)]
    result = {
        "model": first["model"],
        "dtype": first.get("dtype"),
        "cluster": "two Ray nodes of one CPU each on this machine (ray.cluster_utils), one replica per node's CPU",
        "config": cfg,
        # what the answers' cached_tokens count: every prompt token not computed for the request (a prefix kept by an
        # earlier request, or computed in the same run for a sibling question or another request)
        "cached_counts": CACHED_COUNTS,
        "default_lead": default_lead,
        "route": dataclasses.asdict(RouteSettings()),
        "draws": run.args.draws,
        "rows": rows,
        "spread": spread(rows),
        "targets_by_draw": by_draw,
        "targets": targets_over(by_draw) if run.args.draws > 1 else by_draw[0],
        "met_at_once": sum(all(t["met"] for t in draw) for draw in by_draw),
    }
    path = run.write(result, stem=run.args.name)
    print("\n".join(serve_report(run.written)))
    print(serve_summary(run.written, path))
    return 0


def serve_arm(r: dict) -> str:
    """A serve row's arm as tables name it (rule lead with its lead)."""
    return arms.title("serve", r["arm"]).format(lead=r.get("lead"))


def serve_table(res: dict) -> list[str]:
    """Per workload and arm (and draw, where there were several), req/s, latency, cached share, the split over
    replicas and the answers against in-process decide(); where the run counted them, the prompt tokens each replica
    computed, all of them a second, and the machine's load as the workload ended."""
    draws = any("draw" in r for r in res["rows"]) and res.get("draws", 1) > 1
    work = all("computed_per_s" in r for r in res["rows"])
    head = ["workload", "arm", *(["draw"] if draws else []), "req/s", "p50 s", "p99 s", "cached share"]
    head += ["requests per replica", "documents split"]
    head += ["computed tokens per replica", "computed tokens/s", "load (1 min)"] if work else []
    rows = []
    for r in res["rows"]:
        split = f"{r['documents_split']} of {r['documents_asked_again']}" if r["documents_asked_again"] else "—"
        vs = r["vs_in_process"]
        cells = [r["workload"], serve_arm(r), *([r["draw"]] if draws else []), f"{r['req_per_s']:.3f}"]
        cells += [f"{r['p50_s']:.2f}", f"{r['p99_s']:.2f}", f"{r['cached_share']:.1%}"]
        cells += ["/".join(map(str, r["by_replica"])), split]
        if work:
            cells += ["/".join(map(str, r["computed_by_replica"])), f"{r['computed_per_s']:.0f}", f"{r['load_1m']:.2f}"]
        rows.append([*cells, f"{vs['max_prob_diff']:.1e}, {len(vs['picks_differ'])} of {vs['questions']}"])
    return report.table([*head, "vs in-process: largest gap, picks changed"], rows)


def serve_spread_table(res: dict) -> list[str]:
    """Over several draws: each arm's figures on each workload, median (min-max) over its draws."""

    def cell(s: dict, fmt: str) -> str:
        return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"

    head = ["workload", "arm", "draws", "req/s median (min-max)", "p50 s", "p99 s", "cached share"]
    rows = []
    for r in res["spread"]:
        split = ", ".join(map(str, r["documents_split"])) + f" of {r['documents_asked_again']}"
        rows.append(
            [r["workload"], serve_arm(r), r["draws"], cell(r["req_per_s"], ".3f"), cell(r["p50_s"], ".2f")]
            + [cell(r["p99_s"], ".2f"), cell(r["cached_share"], ".1%"), split if r["documents_asked_again"] else "—"]
        )
    return report.table([*head, "documents split, each draw"], rows)


def serve_target_line(t: dict) -> str:
    """One target: its value (over draws: the median, each draw's value and in how many it was met)."""
    verdict = "met" if t["met"] else "MISSED"
    if "values" not in t:
        return f"- {t['target']}: {t['value']} ({verdict})"
    each = ", ".join(map(str, t["values"]))
    where = "every draw" if t["met"] else "some draws"
    return (
        f"- {t['target']}: median {t['value']}, each draw {each} (min {t['min']}, max {t['max']}); met in "
        f"{t['met_in']} of {len(t['values'])} draws ({verdict} in {where})"
    )


def serve_report(res: dict) -> list[str]:
    """serve: what ran, the spread over draws (where there were several), the table, then the targets."""
    c = res["config"]
    names = c.get("workloads", ["reask", "distinct", "hot"])
    work = [f"re-ask {c['docs']} documents x {c['asks']} asks"]
    work += [f"distinct {2 * c['docs']} documents"] if "distinct" in names else []
    lines = [
        f"{res['model']} in {res['dtype']} on {res['cluster']}; documents of ~{c['words']:,} words; "
        f"{' and '.join(work)} from {c['clients']} clients"
        + (f", hot {c['hot_requests']} requests from {2 * c['clients']}" if "hot" in names else "")
        + f"; BLINK_ROUTE_MAX_LEAD {res['default_lead']} unless the arm says."
        + (
            f" {res['draws']} draws: every arm deployed {res['draws']} times, the arms taking turns (new replica ids "
            "each time, so new homes for the documents)."
            if res.get("draws", 1) > 1
            else ""
        ),
        "",
    ]
    if res.get("draws", 1) > 1:
        lines += ["Over the draws:", "", *serve_spread_table(res), "", "Each draw:", ""]
    lines += [*serve_table(res), "", *(serve_target_line(t) for t in res["targets"])]
    if res.get("draws", 1) > 1:
        lines.append(f"- draws meeting every target at once: {res['met_at_once']} of {res['draws']}")
    return lines


def serve_summary(res: dict, path: str) -> str:
    """serve's last line: evidence routing's re-ask figures against one replica and the other routers (medians over
    the draws), and the hot workload's p99."""
    if res.get("spread"):
        at = {
            (r["workload"], r["arm"]): {k: r[k]["median"] for k in ("req_per_s", "p99_s", "cached_share")}
            for r in res["spread"]
            if "lead" not in r
        }
    else:
        at = {(r["workload"], r["arm"]): r for r in res["rows"] if "lead" not in r}
    ev = at[("reask", "evidence")]
    peers = ", ".join(
        f"{ev['req_per_s'] / at[('reask', peer)]['req_per_s']:.2f}x {arms.title('serve', peer)}"
        for peer in ("one_replica", "pow2", "prefix_tree")
    )
    hot = (
        f"hot p99 {at[('hot', 'evidence')]['p99_s']:.1f} s (pow2 {at[('hot', 'pow2')]['p99_s']:.1f} s); "
        if ("hot", "evidence") in at
        else ""
    )
    met = sum(t["met"] for t in res["targets"])
    return (
        f"blink on Ray Serve ({'quick' if res['quick'] else 'full'}, {res['hardware']}, {res['duration_s']:.0f} s): "
        f"re-ask under evidence {ev['req_per_s']:.2f} req/s = {peers}; cached share {ev['cached_share']:.1%} "
        f"(one replica {at[('reask', 'one_replica')]['cached_share']:.1%}); {hot}targets met {met} of "
        f"{len(res['targets'])}; "
        f"results {os.path.relpath(path)}"
    )


REPORT = (
    serve_report,
    ("model", "dtype", "cluster", "config", "default_lead", "rows", "targets", "draws", "spread", "met_at_once"),
)
