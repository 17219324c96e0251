"""blink on vLLM against blink on torch, on one model, side by side in one run, over HTTP.

    python -m bench vllm_check [--model ID] [--requests 40] [--threads 1]   # writes bench/results/vllm-cpu.json
    python -m bench vllm_check --quick      # 8 requests; 4 HTTP requests per level, 1 and 4 clients (-quick.json)

Runs where the vLLM environment exists (.venv-vllm, built by `bash tools/setup.sh --vllm`: vLLM pins its own torch
and transformers, so blink on vLLM runs there and blink on torch in .venv, where this benchmark runs). Without it,
it prints why and exits 0: skipped, nothing measured.

Four `python app.py` servers on the same model (the registry's "vllm_check" arms, bench/lib/arms.py), started side by
side and each idle while another is measured: blink on torch in float32 and in bfloat16 (.venv), blink on vLLM
(BLINK_BACKEND=vllm) in float32 and in bfloat16 (.venv-vllm). Beside them vLLM's own server (`python -m
vllm.entrypoints.openai.api_server`: vllm-cpu 0.32's `vllm` command cannot find its own version, its distribution
being named vllm-cpu) with raw log-probs.

1. Answers: the same generated System One requests (every question type, structured descriptions, unicode, JSON
   evidence, a 200-option choice that vLLM reads in two runs of label ids) through each blink server's
   /v1/systemone. Per arm against blink on torch in float32 (bench/lib/answers.py): the largest probability gap (p(yes)
   for a noul) and every pick that differs, with how far torch's own top two stood apart. This is the bfloat16 gap
   the dtype rule rests on.
2. Throughput, at blink's dtype (bfloat16 where the CPU computes it natively): blink on torch (`python app.py` at
   its defaults, the answer cache on) against blink on vLLM, every other server stopped first. Two workloads of one
   choice over a ~120-token ticket log per request (bench/lib/workloads.py), each at 1, 8 and 32 concurrent clients
   (peers.http_drive), 64 requests per level: DISTINCT, every request new (no answer and no whole prompt can be
   reused), and REPEATED, the same 64 requests asked once unclocked and then sent again at every level (agents
   re-ask, clients retry). Requests/s and p50/p99 latency per arm; the target: blink on torch >= 1.0x blink on
   vLLM's requests/s at every level of both workloads.
3. vLLM's own decision route: /v1/systemone with its own fixed prompt. Driven like the blink pair where it answers;
   else its answer is recorded (vllm-cpu 0.32 serves the route only for the architectures of its READ_STRATEGIES:
   Qwen3ForCausalLM, Qwen3_5ForConditionalGeneration, ...; a Llama model such as the stand-in gets 501).

Writes the results as JSON and prints a summary; exits 1 when an arm could not answer.
"""

from __future__ import annotations

import contextlib
import os
import subprocess

import blink
from bench.lib import answers, arms, harness, report, servers, workloads
from bench.peers.vllm_arm import VLLM_PYTHON, app_env, missing, python_of, vllm_args, vllm_env
from tests import systemone_requests

# torch-bound: loaded when the check starts, not when `python -m bench report` reads this module's tables
peers = harness.lazy("bench.peers.decision")

ARMS = arms.of("vllm_check")
REFERENCE = next(iter(ARMS))  # what every arm's answers are compared with: blink on torch in float32
OWN_ROUTE = "vLLM's own /v1/systemone"
START_S = 900  # three vLLM engines and two torch apps start side by side on a small machine
# The two HTTP workloads (workloads.DISTINCT and REPEATED): one choice over a ~doc-token ticket log per request,
# per_level requests at each level of concurrent clients
HTTP = {
    "full": {"doc": 120, "clients": [1, 8, 32], "per_level": 64},
    "quick": {"doc": 60, "clients": [1, 4], "per_level": 4},
}
VLLM_TARGET = 1.0  # blink on torch at least this many times blink on vLLM's requests/s, at every level and workload


def workload(count: int, seed: int = 7) -> list[dict]:
    """The requests every arm answers: generated ones plus one choice with 200 options (two vLLM requests)."""
    wide = {"type": "choice", "instructions": "Which code fits?", "criteria": {f"code {i}": None for i in range(200)}}
    return systemone_requests.requests(count - 1, seed) + [{"state": "ticket 4417: refund", "questions": {"w": wide}}]


def own_route_cmd(folder: str, port: int, max_model_len: int) -> list[str]:
    """vLLM's own OpenAI-compatible server on the model folder, with raw log-probs (its decision route needs them)."""
    eager = [] if blink.cuda_available() else ["--enforce-eager"]
    return [
        VLLM_PYTHON,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        folder,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--logprobs-mode",
        "raw_logprobs",
        "--max-model-len",
        str(max_model_len),
        *eager,
        *(["--gpu-memory-utilization", "0.3"] if blink.cuda_available() else []),
    ]


def answers_of(url: str, model: str, requests: list[dict]) -> list[dict]:
    """Each request's System One answers from one server, one request at a time."""
    import httpx

    with httpx.Client(timeout=600) as http:
        out = []
        for req in requests:
            got = http.post(url, json={"model": model, **req})
            got.raise_for_status()
            out.append(got.json()["answers"])
        return out


def vllm_version() -> str:
    """The vLLM version installed in the vLLM environment."""
    done = subprocess.run(
        [VLLM_PYTHON, "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return done.stdout.strip() or done.stderr.strip()[-200:]


def start_all(
    stack: contextlib.ExitStack, model: str, threads: int, max_model_len: int, logs: str
) -> tuple[dict, dict, dict]:
    """Every server up side by side: {target: (url, model name) or a reason it is not up}, {target: seconds from the
    start of them all until it answered} (waited for in turn: for all but the first, an upper bound), and {target:
    an exit stack that stops it} (all of them stop with `stack` too)."""
    watch = harness.Stopwatch()
    folder = blink.model_source(model, blink.Settings().cache_dir)
    base = servers.bench_env(threads)
    stops = {name: stack.enter_context(contextlib.ExitStack()) for name in [*ARMS, OWN_ROUTE]}
    # every process is started before the first is waited for: the engines start side by side
    starting = {
        name: stops[name].enter_context(
            servers.app_started(app_env(model, arm, max_model_len), logs, base, python_of(arm))
        )
        for name, arm in ARMS.items()
    }
    port = servers.free_port()
    own_cmd = own_route_cmd(folder, port, max_model_len)
    own_log = os.path.join(logs, "vllm-serve.log")
    own_url = f"http://127.0.0.1:{port}/"
    own = servers.started(own_cmd, own_url, own_log, {**base, **vllm_env()})
    starting[OWN_ROUTE] = stops[OWN_ROUTE].enter_context(own)
    up, up_after = {}, {}
    for name, server in starting.items():
        served = folder if name == OWN_ROUTE else model
        why = server.wait("health" if name == OWN_ROUTE else "", START_S).down
        up_after[name] = round(watch.seconds(), 1)
        url = server.url + "v1/systemone"
        up[name] = why or peers.systemone_probe(url, served, workload(2)[0]) or (url, served)
    return up, up_after, stops


def throughput_pair() -> tuple[str, str]:
    """The two arms whose throughput is compared: blink on torch and blink on vLLM, each at the dtype blink's
    defaults pick on this hardware (bfloat16 where the CPU computes it natively, else float32). The torch arm is then
    `python app.py` at its defaults (its BLINK_DTYPE is what the default is here; the answer cache on)."""
    dtype = blink.Settings.from_env({}).compute_dtype
    pick = {arm.settings["backend"]: name for name, arm in ARMS.items() if arm.settings["dtype"] == dtype}
    return pick["torch"], pick["vllm"]


def serving_rows(driven: dict, workloads_: list[workloads.HttpWorkload]) -> list[dict]:
    """Each workload at each level on every driven server ({target: (url, model)}), the servers taking turns per
    level; a REPEATED workload's requests asked once, unclocked, on every server first."""
    rows = []
    for load in workloads_:
        for url, served in driven.values():
            peers.http_prime(url, served, load)
        for clients, requests in load.levels.items():
            for name, (url, served) in driven.items():
                row = peers.http_drive(url, served, requests, clients, load.warm)
                rows.append({"target": name, "workload": load.name, **row})
                print(
                    f"{load.name:>9} {clients:>3} clients {name}: {row['requests_per_s']} req/s, p50 "
                    f"{row['p50_ms']} ms, p99 {row['p99_ms']} ms",
                    flush=True,
                )
    return rows


def serving_targets(rows: list[dict], torch_arm: str, vllm_arm: str, exact: bool) -> list[dict]:
    """blink on torch at least VLLM_TARGET times blink on vLLM's requests/s, per workload and level (each torch row
    gets its ratio); met is None where the levels are not the target's (--quick)."""
    by = {(r["target"], r["workload"], r["clients"]): r for r in rows}
    out = []
    for (target, load, clients), row in by.items():
        theirs = by.get((vllm_arm, load, clients))
        if target != torch_arm or theirs is None or not theirs["requests_per_s"]:
            continue
        value = round(row["requests_per_s"] / theirs["requests_per_s"], 2)
        row[ratio_key(vllm_arm)] = value
        out.append(
            {
                "target": f"{torch_arm} >= {VLLM_TARGET:g}x {vllm_arm} requests/s: {load} requests, {clients} "
                f"client{'' if clients == 1 else 's'}",
                "workload": load,
                "clients": clients,
                "value": value,
                "threshold": VLLM_TARGET,
                "met": value >= VLLM_TARGET if exact else None,
            }
        )
    return out


def flags(ap) -> None:
    """vllm_check's own flags."""
    ap.add_argument("--model", default=blink.STANDIN_MODEL, help="a model both backends load (hub id or folder)")
    ap.add_argument("--requests", type=int, default=None, help="generated requests for the answers part (40, quick 8)")
    ap.add_argument("--max-model-len", type=int, default=4096)


def main(argv: list[str] | None = None) -> int:
    """Start every server, measure answers, stop all but the throughput pair, measure both workloads' throughput,
    write the results file, print a summary."""
    run = harness.Run("vllm_check", argv, __doc__, flags)
    args = run.args
    why = missing()
    if why:
        print(f"skipped: the vLLM arm needs the vLLM environment ({why}); nothing was measured")
        return 0
    http_cfg = HTTP["quick" if run.quick else "full"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(blink.model_source(args.model, blink.Settings().cache_dir))
    loads = [
        workloads.http_workload(tokenizer, kind, http_cfg["clients"], http_cfg["per_level"], http_cfg["doc"])
        for kind in workloads.HTTP_WORKLOADS
    ]
    parity_requests = workload(args.requests or (8 if run.quick else 40))
    torch_arm, vllm_arm = throughput_pair()
    logs = run.files()
    print(f"server logs in {logs}", flush=True)
    run.probe()
    with contextlib.ExitStack() as stack:
        up, up_after, stops = start_all(stack, args.model, run.threads, args.max_model_len, logs)
        print(
            f"servers up after {run.stopwatch.seconds():.0f} s: "
            + "; ".join(f"{k}: {'up' if isinstance(v, tuple) else v}" for k, v in up.items()),
            flush=True,
        )
        blink_arms = {name: up[name] for name in ARMS if isinstance(up[name], tuple)}
        got = {
            name: answers.flat(answers_of(url, served, parity_requests)) for name, (url, served) in blink_arms.items()
        }
        parity = {name: answers.compare(got[REFERENCE], mine) for name, mine in got.items() if name != REFERENCE}
        for name, row in parity.items():
            print(
                f"answers {name}: max |dp| {row['max_prob_diff']:.2e} vs {REFERENCE} on "
                f"{row['questions']} questions, {len(row['picks_differ'])} picks differ",
                flush=True,
            )
        measured = (torch_arm, vllm_arm, OWN_ROUTE)  # vLLM's own route where it answers (a listed architecture)
        driven = {name: up[name] for name in measured if isinstance(up[name], tuple)}
        for name, stop in stops.items():
            if name not in driven:
                stop.close()  # idle servers stopped: nothing but the measured ones on the cores
        serving = serving_rows(driven, loads)
    targets = serving_targets(serving, torch_arm, vllm_arm, exact=not run.quick)
    result = {
        "model": args.model,
        "vllm": vllm_version(),
        "vllm_args": vllm_args(args.max_model_len),
        "vllm_env": vllm_env(),
        "arms": {name: {**arm.settings, "python": arm.python} for name, arm in ARMS.items()},
        "not_up": {name: reason for name in ARMS if not isinstance(reason := up[name], tuple)},
        "up_after_s": up_after,
        "vllm_own_route": ("answered: driven in the http rows" if isinstance(up[OWN_ROUTE], tuple) else up[OWN_ROUTE]),
        "answers": {"requests": len(parity_requests), "reference": REFERENCE, "arms": parity},
        "http": {
            **http_cfg,
            "pair": [torch_arm, vllm_arm],
            "workloads": {load.name: load.what for load in loads},
            "rows": serving,
        },
        "targets": targets,
    }
    path = run.write(result, f"vllm-{'cuda' if blink.cuda_available() else 'cpu'}")
    print(vllm_summary(run.written, path))
    return 1 if result["not_up"] else 0


def vllm_report(res: dict) -> list[str]:
    """vllm_check: each blink arm's answers against the reference's, then /v1/systemone throughput (per workload where
    the file has two: vllm_serving; else per arm and concurrency with the ratio to the reference), then what vLLM's
    own route did."""
    reference = res["answers"]["reference"]
    compared = res["answers"]["arms"]
    lines = [
        f"Answers of {res['answers']['requests']} System One requests against {arms.title('vllm_check', reference)}:",
        "",
        *report.table(
            ["arm", "largest probability gap", "picks that differ"],
            [
                [
                    arms.title("vllm_check", a),
                    f"{r['max_prob_diff']:.2g}",
                    f"{len(r['picks_differ'])} of {r['questions']}",
                ]
                for a, r in compared.items()
            ],
        ),
    ]
    rows = res["http"]["rows"]
    lines += vllm_serving(res) if "workloads" in res["http"] else vllm_levels(rows, reference)
    lines += [
        "",
        "Latency:",
        "",
        *report.table(
            ["arm", *(["workload"] if "workloads" in res["http"] else []), "clients", "requests", "requests/s"]
            + ["p50 (ms)", "p99 (ms)"],
            [
                [
                    arms.title("vllm_check", r["target"]),
                    *([r["workload"]] if "workloads" in res["http"] else []),
                    r["clients"],
                    r["completed"],
                    f"{r['requests_per_s']:.2f}",
                    f"{r['p50_ms']:.0f}",
                    f"{r['p99_ms']:.0f}",
                ]
                for r in rows
            ],
        ),
        "",
        f"vLLM's own route: {res['vllm_own_route']}",
        *(f"Not up: {name}: {why}" for name, why in res["not_up"].items()),
    ]
    return lines


def ratio_key(name: str) -> str:
    """The field of a row holding its requests/s over those of the arm `name` at the same workload and level."""
    return f"vs_{name.replace(' ', '_')}"


def vllm_levels(rows: list[dict], reference: str) -> list[str]:
    """vllm_check files of one workload: requests/s per arm and concurrency, with the ratio to the reference."""
    names = list(dict.fromkeys(r["target"] for r in rows))
    ratio = ratio_key(reference)
    by = {(r["target"], r["clients"]): r for r in rows}
    levels = sorted({r["clients"] for r in rows})

    def rate(name: str, clients: int) -> str:
        r = by.get((name, clients))
        if r is None:
            return "—"
        return f"{r['requests_per_s']:.2f}" + ("" if name == reference else f" ({r[ratio]:.2f}×)")

    return [
        "",
        "Throughput, `/v1/systemone` requests/s (ratio to the reference):",
        "",
        *report.table(
            ["clients", *(arms.title("vllm_check", n) for n in names)],
            [[c, *(rate(n, c) for n in names)] for c in levels],
        ),
    ]


def vllm_serving(res: dict) -> list[str]:
    """vllm_check's two workloads: per workload and concurrency, blink on torch's and blink on vLLM's requests/s and
    their ratio (the target: at least 1.0x), then the targets."""
    torch_arm, vllm_arm = res["http"]["pair"]
    by = {(r["target"], r["workload"], r["clients"]): r for r in res["http"]["rows"]}
    ratio = ratio_key(vllm_arm)
    rows = []
    for load, what in res["http"]["workloads"].items():
        for clients in res["http"]["clients"]:
            mine, theirs = by.get((torch_arm, load, clients)), by.get((vllm_arm, load, clients))
            rows.append(
                [
                    f"{load} ({what})",
                    clients,
                    f"{mine['requests_per_s']:.2f}" if mine else "—",
                    f"{theirs['requests_per_s']:.2f}" if theirs else "—",
                    f"{mine[ratio]:.2f}×" if mine and ratio in mine else "—",
                ]
            )
    verdict = {True: "met", False: "**missed**", None: "the target's levels are measured by the full run"}
    return [
        "",
        f"Throughput, `/v1/systemone` requests/s, {res['http']['per_level']} requests per level:",
        "",
        *report.table(
            [
                "workload",
                "clients",
                arms.title("vllm_check", torch_arm),
                arms.title("vllm_check", vllm_arm),
                f"{arms.title('vllm_check', torch_arm)} / {arms.title('vllm_check', vllm_arm)}",
            ],
            rows,
        ),
        "",
        *(f"- {t['target']}: {t['value']:.2f}x — {verdict[t['met']]}" for t in res.get("targets", [])),
    ]


def vllm_summary(res: dict, path: str) -> str:
    """vllm_check's last line: the answers' largest gap per arm, then the throughput targets."""
    gaps = [
        f"{arms.title('vllm_check', a)} |dp| {r['max_prob_diff']:.2g}, {len(r['picks_differ'])} picks differ"
        for a, r in res["answers"]["arms"].items()
    ]
    verdict = {True: "met", False: "MISSED", None: "quick"}
    rates = [
        f"{t['workload']} x{t['value']:.2f} at {t['clients']} client(s) ({verdict[t['met']]})" for t in res["targets"]
    ]
    torch_arm, vllm_arm = res["http"]["pair"]
    return (
        f"blink vllm_check ({'quick, ' if res['quick'] else ''}{res['hardware']}, {res['duration_s']:.0f} s): "
        f"{'; '.join(gaps)}; {torch_arm} over {vllm_arm} requests/s: {', '.join(rates) or 'not measured'}"
        + "".join(f"; not up: {name}: {why}" for name, why in res["not_up"].items())
        + f"; results {os.path.relpath(path)}"
    )


REPORT = (vllm_report, ("answers", "http", "not_up", "vllm_own_route", "targets"))
