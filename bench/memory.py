"""Resident memory of a blink process under a stream of distinct long documents, against its prefix-cache bound.

    python -m bench memory            # 24 documents of ~3,800 tokens, 4 questions each, bound 1,024 MB (the default)
    python -m bench memory --quick    # 8 documents of ~1,000 tokens, bound 64 MB, a few minutes

Each run is a process of its own, started fresh (its arm is one of the registry's "memory" arms, bench/lib/arms.py):
`decide` calls blink.decide() in a loop; `app` is `python app.py`,
sent System One requests over HTTP (`/v1/systemone`); each in float32 (the exact path, the most memory) or at the
machine's default dtype, with freed memory handed back to the OS after every forward (BLINK_RELEASE_MEMORY on, the
default) or not (off), so the curves show what each does. The
start is the process after loading the model and answering one short question (its weights paged in); after each
document the bench reads the process's resident memory (VmRSS, of which RssAnon is what the process allocated and
RssFile its memory-mapped weights and libraries) and its peak since the document was sent (VmHWM, reset before
each document where the kernel allows it). The target: growth over the start at most the bound plus 768 MB.
Writes bench/results/memory.json (memory-quick.json with --quick); the last line printed is a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import blink
from bench.lib import arms, harness, report, servers, workloads

CONFIGS = {
    "full": {
        "docs": 24,
        "doc_tokens": 3800,
        "questions": 4,
        "bound_mb": 1024,
        "runs": "decide:float32:on,app:float32:on,app:float32:off,decide:default:on,app:default:on",
    },
    "quick": {
        "docs": 8,
        "doc_tokens": 1000,
        "questions": 2,
        "bound_mb": 64,
        "runs": "decide:float32:on,decide:float32:off,app:float32:on",
    },
}
WORKING_SET_MB = 768  # the target: growth over the start at most the bound plus this
MB = 2**20
SHORT = ("The parcel arrived on time.", {"q": {"type": "noul", "instructions": "Did the parcel arrive?"}})


def status(pid: int | str = "self") -> dict[str, int]:
    """A process's resident memory in MB: VmRSS, RssAnon, RssFile and VmHWM (its peak since the last reset)."""
    out = {}
    with open(f"/proc/{pid}/status", encoding="utf-8") as fh:
        for line in fh:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[name] = int(value.split()[0]) // 1024
    return out


def reset_peak(pid: int | str = "self") -> bool:
    """Reset a process's VmHWM to its current resident memory (Linux 4.0+); False where that is not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w", encoding="utf-8") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def documents(tok, cfg: dict) -> list[tuple[str, dict]]:
    """The stream: distinct ticket logs of about cfg['doc_tokens'] tokens, cfg['questions'] questions each."""
    out = []
    for i in range(cfg["docs"]):
        doc = workloads.document(tok, cfg["doc_tokens"], seed=1000 + i)
        out.append((doc, workloads.questions(cfg["questions"], 4, workloads.ticket_count(doc))))
    return out


def sample(pid: int | str, start: dict, seconds: float, peak_reset: bool, extra: dict | None = None) -> dict:
    """One point of the curve: resident memory now, its growth over the start, and the peak while the document ran."""
    now = status(pid)
    point = {
        "rss_mb": now["VmRSS"],
        "anon_mb": now["RssAnon"],
        "file_mb": now["RssFile"],
        "growth_mb": now["VmRSS"] - start["VmRSS"],
        "anon_growth_mb": now["RssAnon"] - start["RssAnon"],
        "peak_growth_mb": now["VmHWM"] - start["VmRSS"] if peak_reset else None,
        "seconds": round(seconds, 1),
    }
    return {**point, **(extra or {})}


def decide_child(cfg: dict) -> None:
    """The `decide` arm inside its own process: one JSON line for the start, then one per document."""
    dep = blink.Deployment(blink.Settings.from_env())
    engine = dep.engine()
    live = getattr(engine, "live", engine)
    stream = documents(live.tok, cfg)
    dep.decide(*SHORT)
    start = status()
    print(json.dumps({"start": start, "settings": describe(live)}), flush=True)
    for doc, questions in stream:
        peak_reset = reset_peak()
        seconds = harness.timed(lambda: dep.decide(doc, questions))[0]  # noqa: B023 (called at once)
        held = {"held_mb": round(live.prefixes.held_bytes() / MB, 1)}
        print(json.dumps(sample("self", start, seconds, peak_reset, held)), flush=True)


def describe(engine) -> dict:
    """What the arm ran: the engine's compute settings and its prefix-cache bound."""
    return {
        **engine.compute,
        "prefix_cache_mb": engine.settings.prefix_cache_mb,
        "release_memory": engine.settings.release_memory,
    }


def run_decide(cfg: dict, env: dict) -> dict:
    """The `decide` arm: its process's lines, read as they come."""
    cmd = [sys.executable, "-m", "bench", "memory", "--child", json.dumps(cfg)]
    proc = subprocess.Popen(cmd, cwd=servers.ROOT, env=env, stdout=subprocess.PIPE, text=True)
    first, points = None, []
    for line in proc.stdout:
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if first is None:
            first = row
        else:
            points.append(row)
            print(
                f"  decide {len(points):>3}: {row['rss_mb']} MB, +{row['growth_mb']} (anon +{row['anon_growth_mb']}"
                f", peak +{row['peak_growth_mb']}), prefixes {row['held_mb']} MB, {row['seconds']} s",
                flush=True,
            )
    if proc.wait() != 0:
        raise RuntimeError(f"the decide arm exited with status {proc.returncode}")
    return {"start_mb": first["start"]["VmRSS"], "settings": first["settings"], "points": points}


def run_app(cfg: dict, env: dict, stream: list[tuple[str, dict]]) -> dict:
    """The `app` arm: `python app.py` in its own process, the stream posted to /v1/systemone one at a time."""
    import httpx

    with tempfile.TemporaryDirectory() as logs, servers.app({}, logs, env) as app:
        if app.down:
            raise RuntimeError(f"the app did not come up: {app.down}\n{servers.log_tail(app.log)}")
        url = app.url + "v1/systemone"
        with httpx.Client(timeout=1800) as http:

            def post(state, questions: dict) -> None:
                body = {"model": blink.STANDIN_MODEL, **workloads.system_one(state, questions)}
                http.post(url, json=body).raise_for_status()

            post(*SHORT)
            start = status(app.proc.pid)
            points = []
            for doc, questions in stream:
                peak_reset = reset_peak(app.proc.pid)
                seconds = harness.timed(lambda: post(doc, questions))[0]  # noqa: B023 (called at once)
                row = sample(app.proc.pid, start, seconds, peak_reset)
                points.append(row)
                print(
                    f"  app    {len(points):>3}: {row['rss_mb']} MB, +{row['growth_mb']} (anon "
                    f"+{row['anon_growth_mb']}, peak +{row['peak_growth_mb']}), {row['seconds']} s",
                    flush=True,
                )
    return {"start_mb": start["VmRSS"], "points": points}


def verdict(arm: dict, bound_mb: int) -> dict:
    """An arm's largest growth over the start (after a document, and at its peak) against bound + WORKING_SET_MB."""
    growth = max(p["growth_mb"] for p in arm["points"])
    peaks = [p["peak_growth_mb"] for p in arm["points"] if p["peak_growth_mb"] is not None]
    return {
        "max_growth_mb": growth,
        "max_peak_growth_mb": max(peaks) if peaks else None,
        "last_growth_mb": arm["points"][-1]["growth_mb"],
        "within_target": growth <= bound_mb + WORKING_SET_MB,
    }


def flags(ap) -> None:
    """memory's own flags."""
    ap.add_argument("--docs", type=int, help="documents in the stream")
    ap.add_argument("--doc-tokens", type=int, help="tokens per document")
    ap.add_argument("--bound-mb", type=int, help="BLINK_PREFIX_CACHE_MB")
    ap.add_argument(
        "--runs",
        help="comma-separated ARM:DTYPE:RELEASE, ARM decide or app, DTYPE float32, bfloat16 or "
        "default (BLINK_DTYPE unset), RELEASE on or off (BLINK_RELEASE_MEMORY)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)


def main(argv: list[str] | None = None) -> int:
    """Run each arm with and without releasing freed memory; write JSON; print one summary line last."""
    run = harness.Run("memory", argv, __doc__, flags, threads="0")
    args = run.args
    if args.child:
        decide_child(json.loads(args.child))
        return 0
    cfg = dict(CONFIGS["quick" if run.quick else "full"])
    cfg.update(
        {
            k: v
            for k, v in (("docs", args.docs), ("doc_tokens", args.doc_tokens), ("bound_mb", args.bound_mb))
            if v is not None
        }
    )
    from transformers import AutoTokenizer

    stream = documents(
        AutoTokenizer.from_pretrained(blink.model_source(blink.STANDIN_MODEL, blink.Settings().cache_dir)), cfg
    )
    run.threads = run.threads or os.cpu_count()  # 0: every core
    run.probe()
    runs = []
    for spec in (args.runs or cfg["runs"]).split(","):
        arm, dtype, release = spec.split(":")
        if arm not in arms.of("memory"):
            raise SystemExit(f"--runs: no memory arm {arm!r} (the arms: {', '.join(arms.of('memory'))})")
        env = {
            **servers.bench_env(run.threads),
            "BLINK_PREFIX_CACHE_MB": str(cfg["bound_mb"]),
            "BLINK_RELEASE_MEMORY": release,
            "BLINK_MODEL": blink.STANDIN_MODEL,
            **({} if dtype == "default" else {"BLINK_DTYPE": dtype}),
        }
        print(f"{arm}, dtype {dtype}, BLINK_RELEASE_MEMORY={release}:", flush=True)
        got = run_decide(cfg, env) if arm == "decide" else run_app(cfg, env, stream)
        runs.append(
            {"arm": arm, "dtype": dtype, "release_memory": release == "on", **got, **verdict(got, cfg["bound_mb"])}
        )
    res = {
        "config": cfg,
        "target_mb": cfg["bound_mb"] + WORKING_SET_MB,
        "runs": runs,
        "notes": [
            "growth_mb: VmRSS after the document less VmRSS at the start (the model loaded and one short "
            "question answered); peak_growth_mb: VmHWM while the document ran, less the same start.",
            "The target: growth at most the prefix-cache bound (BLINK_PREFIX_CACHE_MB) plus 768 MB.",
        ],
    }
    path = run.write(res)
    print(memory_summary(run.written, path))
    return 0


def memory_table(res: dict) -> list[str]:
    """Each run's resident-memory growth over its start along the stream, against the target."""
    docs = res["config"]["docs"]
    marks = sorted({1, docs // 2, docs})
    head = ["run", "dtype", "freed memory released", "start MB"]
    head += [f"growth after document {'/'.join(map(str, marks))} (MB)", "largest peak growth (MB)"]
    head += [f"within bound + {res['target_mb'] - res['config']['bound_mb']} MB"]
    rows = [
        [r["arm"], r["dtype"], "yes" if r["release_memory"] else "no", r["start_mb"]]
        + ["/".join(f"+{r['points'][m - 1]['growth_mb']}" for m in marks), f"+{r['max_peak_growth_mb']}"]
        + ["yes" if r["within_target"] else "no"]
        for r in res["runs"]
    ]
    return report.table(head, rows)


def memory_summary(res: dict, path: str) -> str:
    """memory's last line: each run's largest growth and peak against the target."""
    parts = [
        f"{r['arm']} {r['dtype']} {'released' if r['release_memory'] else 'kept'} +{r['max_growth_mb']} MB"
        f" (peak +{r['max_peak_growth_mb']})"
        for r in res["runs"]
    ]
    mode = "quick" if res["quick"] else "full"
    return (
        f"blink memory ({mode}, {res['config']['docs']} documents of ~{res['config']['doc_tokens']} "
        f"tokens, bound {res['config']['bound_mb']} MB, target +{res['target_mb']} MB): {'; '.join(parts)}; "
        f"results {os.path.relpath(path)}"
    )


REPORT = (memory_table, ("runs", "config", "target_mb"))
