"""The systems a user would pick instead of blink, on the same model, and how `python -m bench run` drives them:
transformers' `pipeline("decision")` (its own prompt; blink's prompt through the DecisionConfig `python blink.py export`
writes; its own prompt on blink's own model where blink's dtype is not the checkpoint's), llama.cpp
(bench/peers/llamacpp.py) and blink on vLLM (bench/peers/vllm_arm.py) on the three decision cases, and `transformers
serve` `/v1/systemone` against blink's own `/v1/systemone` over HTTP. Each is an arm of the registry
(bench/lib/arms.py); an arm whose system is missing here is skipped with the reason, never faked.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

import blink
from bench.lib import answers, arms, grid, harness, servers, workloads
from bench.peers import throughput


@dataclass
class PeerContext:
    """What starting a decision peer may need: the loaded engine, the CPU threads a peer gets, a folder for servers'
    logs, the exit stack that stops what was started, and blink's exported prompt (or why there is none)."""

    engine: blink.TorchEngine
    threads: int
    logs: str
    stack: contextlib.ExitStack
    export_dir: str | None = None
    export_missing: str | None = None


def start_peers(ctx: PeerContext, names: list[str]) -> tuple[dict[str, Callable], list[dict]]:
    """The named decision arms started ({name: a callable answering System One bodies}), and a row for each arm that
    cannot run here saying why."""
    pipes, skipped = {}, []
    for name in names:
        arm = arms.of("decision")[name]
        started = arm.function()(arm, ctx)
        if isinstance(started, str):
            skipped.append({"target": name, "skipped": started})
        else:
            pipes[name] = started
    return pipes, skipped


# ---------------------------------------------------------------------------------------------------------------
# pipeline("decision")
# ---------------------------------------------------------------------------------------------------------------


def decision_pipeline(engine: blink.TorchEngine, config=None, model=None):
    """transformers' decision pipeline on the engine's weights as a user loads them (grid.user_model) or on `model`,
    with a tokenizer of its own (the pipeline adds its mark/split tokens to the tokenizer it is given, which would
    change how blink tokenizes those strings).
    config: a DecisionConfig or its folder (decision.json + decision_template.jinja); None: its built-in prompt."""
    from transformers import AutoTokenizer, pipeline

    tok = AutoTokenizer.from_pretrained(engine.source)
    kwargs = {"decision_config": config} if config else {}
    model = model if model is not None else grid.user_model(engine)
    return pipeline("decision", model=model, tokenizer=tok, device=model.device, **kwargs)


def own_pipeline(engine: blink.TorchEngine, dtype: torch.dtype):
    """transformers' decision pipeline as a user runs it at `dtype`, its own prompt: its own model and tokenizer freshly
    loaded from the engine's checkpoint, the model by AutoModelForCausalLM at `dtype` (what `pipeline("decision",
    model=<checkpoint>, dtype=dtype)` loads for a causal LM such as the stand-in; for a Qwen3.5 config that call
    loads transformers' JevForDecision instead, a decision head of its own that a causal LM checkpoint does not
    carry), on the engine's device."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    device = engine.model.lm_head.weight.device
    model = AutoModelForCausalLM.from_pretrained(engine.source, revision=engine.revision, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(engine.source, revision=engine.revision)
    return pipeline("decision", model=model.to(device).eval(), tokenizer=tok, device=device)


class CountedPipeline:
    """A decision pipeline answering System One bodies, counting the prompt tokens its model computes (a forward
    pre-hook reads every call's input_ids; removed by close())."""

    def __init__(self, pipe):
        self.pipe, self.tokens = pipe, 0
        self.dtype = blink.dtype_name(pipe.model.dtype)
        self.hook = pipe.model.register_forward_pre_hook(self.count, with_kwargs=True)

    @property
    def model(self):
        """The pipeline's model."""
        return self.pipe.model

    def count(self, module, args: tuple, kwargs: dict) -> None:
        """Add one forward's prompt tokens (its input_ids, every row: the pipeline runs one prompt per call)."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.tokens += int(ids.numel()) if ids is not None else 0

    def computed_tokens(self) -> int:
        """Prompt tokens the pipeline's model has computed so far."""
        return self.tokens

    def close(self) -> None:
        """Stop counting."""
        self.hook.remove()

    def __call__(self, body: dict) -> list:
        return self.pipe(body)


def counted(pipe, ctx: PeerContext) -> CountedPipeline:
    """The pipeline counting its prompt tokens until ctx.stack closes."""
    peer = CountedPipeline(pipe)
    ctx.stack.callback(peer.close)
    return peer


def start_pipeline(arm: arms.Arm, ctx: PeerContext):
    """The pipeline with its own built-in prompt, on the model as from_pretrained loads it."""
    return counted(decision_pipeline(ctx.engine), ctx)


def start_pipeline_export(arm: arms.Arm, ctx: PeerContext):
    """The pipeline reading blink's exported DecisionConfig, or why there is none."""
    return counted(decision_pipeline(ctx.engine, ctx.export_dir), ctx) if ctx.export_dir else ctx.export_missing


def start_pipeline_bfloat16(arm: arms.Arm, ctx: PeerContext):
    """The pipeline as a user runs it at blink's dtype, bfloat16 (own_pipeline: its own model, freshly loaded), or
    why it is not a separate arm here."""
    dtype = ctx.engine.model.dtype
    if dtype != torch.bfloat16 or dtype == grid.user_model(ctx.engine).dtype:
        return f"blink computes in {blink.dtype_name(dtype)}, the dtype the pipeline arm already runs"
    return counted(own_pipeline(ctx.engine, dtype), ctx)


class BlinkPipe:
    """blink under an arm's settings, its own engine behind a Deployment, answering System One bodies; counts the
    prompt tokens it computed (meta.prefill_tokens) and names its dtype (its quantization where it has one) and the
    dtype its products run in (under int8, the compute dtype its weights widen to: its matmul probe)."""

    def __init__(self, engine: blink.TorchEngine):
        self.dep = blink.Deployment.serving(engine)
        self.product_dtype = engine.settings.compute_dtype
        self.dtype = "int8" if engine.settings.quantize == "int8" else self.product_dtype
        self.tokens = 0

    def computed_tokens(self) -> int:
        """Prompt tokens computed so far."""
        return self.tokens

    def __call__(self, body: dict) -> dict:
        out = self.dep.decide(body["state"], body["questions"])
        self.tokens += out["meta"]["prefill_tokens"]
        return out["answers"]


def start_blink(arm: arms.Arm, ctx: PeerContext) -> BlinkPipe:
    """blink under the arm's settings over blink's defaults, its model loaded once more for it."""
    return BlinkPipe(arms.engine(arm, ctx.engine.model_id, ctx.engine.settings))


def export_config(model: str, folder: str) -> str | None:
    """blink's prompt as a transformers DecisionConfig, written by `python blink.py export FOLDER --model MODEL`;
    None (and why) when this blink has no export command or it failed."""
    cmd = [sys.executable, os.path.join(servers.ROOT, "blink.py"), "export", folder, "--model", model]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`python blink.py export` did not finish: {exc}"
    if done.returncode or not os.path.exists(os.path.join(folder, "decision.json")):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"`python blink.py export` is not available here ({last[:160]})"
    return None


# ---------------------------------------------------------------------------------------------------------------
# The three cases a user meets first: many questions over a document, the same document again, one short question
# ---------------------------------------------------------------------------------------------------------------


def decision_cases(engine: blink.TorchEngine, cfg: dict, pipes: dict) -> dict:
    """blink at its defaults (a Deployment serving the engine) against each peer on the three cases, interleaved per
    request so both sides see the same machine (a peer with processes of its own is waited for until they are idle
    before the next arm is timed: harness.settle); what each computed (computed_work); plus every blink answer of
    the first repetition against the cold, unbatched path (each question alone, by hand)."""
    dep = blink.Deployment.serving(engine)
    dep.decide("warm-up", {"w": {"type": "noul"}})
    for pipe in pipes.values():
        pipe(workloads.system_one("warm-up", {"w": {"type": "noul"}}))
    names = ("blink", *pipes)
    times: dict = {case: {arm: [] for arm in names} for case in workloads.CASES}
    tokens: dict = {
        case: {arm: [] for arm in names} for case in workloads.CASES
    }  # computed per request (None: unknown)
    answered: dict = {}  # (case, arm): the first repetition's answers, one per request
    settled: dict = {case: {} for case in workloads.CASES}  # seconds waited for an arm's own processes to go idle
    first: dict = {}  # the first repetition's requests, checked against the unbatched path below
    for rep in range(cfg["reps"]):
        requests = workloads.case_requests(engine.tok, cfg, rep)
        first = first or requests
        for case in workloads.CASES:  # "again" follows "document": its document is the one blink has just seen
            for state, questions in requests[case]:
                for name, pipe in pipes.items():
                    elsewhere = getattr(pipe, "elsewhere_cpu", lambda: 0.0)  # a peer's own processes
                    computed = getattr(pipe, "computed_tokens", lambda: None)
                    before, tokens_before = elsewhere(), computed()
                    body = workloads.system_one(state, questions)
                    wall, cpu, out = harness.timed(lambda: pipe(body))  # noqa: B023 (called at once)
                    times[case][name].append((wall, cpu + elsewhere() - before))
                    tokens[case][name].append(None if tokens_before is None else computed() - tokens_before)
                    if hasattr(pipe, "elsewhere_cpu"):  # its processes idle before the next arm is timed
                        settled[case][name] = settled[case].get(name, 0.0) + harness.settle(elsewhere)
                    if rep == 0:
                        answered.setdefault((case, name), []).append(out)
                wall, cpu, out = harness.timed(lambda: dep.decide(state, questions))  # noqa: B023 (called at once)
                times[case]["blink"].append((wall, cpu))
                tokens[case]["blink"].append(out["meta"]["prefill_tokens"])
                if rep == 0:
                    answered.setdefault((case, "blink"), []).append(out)
    rows = {}
    for case in workloads.CASES:
        state, questions = first[case][0]
        meta = answered[(case, "blink")][0]["meta"]
        mine = answers.flat([out["answers"] for out in answered[(case, "blink")]])
        row = {
            "questions": len(questions),
            "requests_per_rep": len(first[case]),
            "prompt_tokens": meta["input_tokens"],
            "prefill_tokens": meta["prefill_tokens"],
            "cached_tokens": meta["cached_tokens"],
            "arms": {},
        }
        for arm, runs in times[case].items():
            dtype = blink.dtype_name(engine.model.dtype) if arm == "blink" else getattr(pipes[arm], "dtype", None)
            product = getattr(pipes.get(arm), "product_dtype", None)
            row["arms"][arm] = {
                "wall_s": [round(w, 4) for w, _ in runs],
                "cpu_s": [round(c, 4) for _, c in runs],
                "total_wall_s": round(sum(w for w, _ in runs), 4),
                "total_cpu_s": round(sum(c for _, c in runs), 4),
                **computed_work(engine.prefill_cost, tokens[case][arm], sum(w for w, _ in runs), dtype),
                **({"product_dtype": product} if product and product != dtype else {}),
            }
        for name in pipes:
            theirs = answers.compare(mine, answers.flat(answered[(case, name)]))
            row[f"vs_{name}"] = {
                "wall": ratio(row["arms"], name, "total_wall_s"),
                "cpu": ratio(row["arms"], name, "total_cpu_s"),
                "per_rep_wall": [round(p[0] / b[0], 2) for p, b in zip(times[case][name], times[case]["blink"])],
                "picks_differ_from_blink": sorted(theirs["picks_differ"]),
                "max_prob_diff_from_blink": theirs["max_prob_diff"],
            }
        cold = [unbatched_answers(engine, state, questions) for state, questions in first[case]]
        row["vs_unbatched"] = answers.compare(answers.flat(cold), mine)
        row["settled_s"] = {name: round(waited, 2) for name, waited in settled[case].items()}
        rows[case] = row
    return rows


def computed_work(cost: blink.PrefillCost, tokens: list[int | None], wall_s: float, dtype: str | None) -> dict:
    """What an arm computed over a case: the prompt tokens its model ran (None where it does not say), the prefill
    FLOPs of the non-embedding weights those need (2 x those weights per token: PrefillCost.token_flops; attention
    left out), the rate it ran them at, and the dtype it computes in (its matmul probe: utilisation())."""
    if any(t is None for t in tokens):
        return {"computed_tokens": None, "dtype": dtype}
    gflop = cost.token_flops * sum(tokens) / 1e9
    return {
        "computed_tokens": sum(tokens),
        "model_gflop": round(gflop, 3),
        "gflops": round(gflop / wall_s, 2) if wall_s > 0 else None,
        "dtype": dtype,
    }


def utilisation(decision: dict, probe_of) -> None:
    """Each arm's model FLOP utilisation in every case (harness.utilisation): its model_gflop over its time, against
    the matmul probe at the dtype its products run in (its product_dtype where it has one, else its dtype;
    `probe_of(dtype)` -> (dtype probed, GFLOP/s): harness.Run's matmul_probe), written beside its times."""
    for row in decision.values():
        for arm in row["arms"].values():
            if arm.get("model_gflop") is None:
                continue
            arm["probe_dtype"], probe = probe_of(arm.get("product_dtype", arm["dtype"]))
            arm["matmul_gflops"] = round(probe, 2)
            share = harness.utilisation(arm["model_gflop"] * 1e9, arm["total_wall_s"], probe)
            arm["utilisation"] = None if share is None else round(share, 3)


def ratio(arms_: dict, peer: str, clock: str) -> float:
    """How many times faster blink answered than the peer over all repetitions (> 1: blink faster)."""
    return round(arms_[peer][clock] / arms_["blink"][clock], 2) if arms_["blink"][clock] > 0 else float("nan")


def unbatched_answers(engine: blink.TorchEngine, state, questions: dict) -> dict:
    """Each question's prompt run alone through the plain model, by hand (grid.unbatched_one): its distribution over
    the options at temperature 1."""
    out = {}
    for key, q in questions.items():
        alone = grid.unbatched_one(engine, state, key, q)
        keys = [o.key for o in blink.parse_question(key, q).rows[0].shown]
        out[key] = {"probabilities": dict(zip(keys, blink.softmax(alone.rows[key], 1.0)))}
    return out


# ---------------------------------------------------------------------------------------------------------------
# Over HTTP: transformers serve /v1/systemone against blink's /v1/systemone
# ---------------------------------------------------------------------------------------------------------------


def transformers_serve_cmd(folder: str, port: int, config_json: str | None) -> list[str] | str:
    """The `transformers serve` command for the model folder (bfloat16 on a GPU, as blink), or why it cannot run
    here."""
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        return "transformers serve needs its serving extras (pip install 'transformers[serving]': openai)"
    cli = os.path.join(os.path.dirname(sys.executable), "transformers")
    device = ["--device", "cuda", "--dtype", "bfloat16"] if torch.cuda.is_available() else ["--device", "cpu"]
    cmd = [cli, "serve", folder, *device, "--host", "127.0.0.1", "--port", str(port)]
    return cmd + (["--decision-config", config_json] if config_json else [])


def serve_config(export_dir: str) -> str:
    """transformers serve reads --decision-config as JSON only: the export's decision_serve.json (decision.json with
    the template embedded), which `python blink.py export` always writes."""
    return os.path.join(export_dir, "decision_serve.json")


def http_drive(url: str, model: str, requests: list[dict], clients: int, warm: dict | None = None) -> dict:
    """`clients` threads, each with its own HTTP connection, posting System One requests back to back: client c sends
    requests[c * per_client + r], r < per_client = len(requests) // clients. `warm` is sent first, unclocked: the
    server answers at all, and is warm, before the clock starts."""
    import httpx

    per_client = max(1, len(requests) // clients)
    conns = [httpx.Client(timeout=600) for _ in range(clients)]

    def post(conn, body: dict) -> dict:
        got = conn.post(url, json={"model": model, **body})
        got.raise_for_status()
        return got.json()

    try:
        post(conns[0], warm or requests[0])
        row = throughput.drive(lambda c, r: post(conns[c], requests[c * per_client + r]), clients, per_client)
        row.pop("mean_batched_requests")  # a System One answer has no meta to read it from
        return row
    finally:
        for conn in conns:
            conn.close()


def http_prime(url: str, model: str, workload: workloads.HttpWorkload) -> None:
    """A workload's primed requests asked once, one after another, before its clock starts."""
    import httpx

    with httpx.Client(timeout=600) as http:
        for body in workload.primed:
            http.post(url, json={"model": model, **body}).raise_for_status()


def http_rows(engine: blink.TorchEngine, cfg: dict, threads: int, export_dir: str | None, log_dir: str) -> list[dict]:
    """Both servers up side by side (idle while the other is measured), each concurrency level measured on one then
    the other, every request new (the DISTINCT workload: transformers serve keeps nothing across requests, blink's
    answer cache would answer a repeat); a server that cannot run here is one row saying why."""
    workload = workloads.http_workload(engine.tok, workloads.DISTINCT, cfg["clients"], cfg["per_level"], cfg["doc"])
    serve, own = arms.of("http")
    port = servers.free_port()
    serve_cmd = transformers_serve_cmd(engine.source, port, serve_config(export_dir) if export_dir else None)
    rows: list[dict] = []
    targets = {}
    with contextlib.ExitStack() as stack:
        if isinstance(serve_cmd, str):
            rows.append({"target": serve, "skipped": serve_cmd})
        else:
            url = f"http://127.0.0.1:{port}/"
            log = os.path.join(log_dir, "transformers-serve.log")
            up = stack.enter_context(
                servers.running(serve_cmd, url, log, servers.bench_env(threads), health="health", timeout_s=300)
            )
            if up.down:
                rows.append({"target": serve, "skipped": up.down})
            else:
                targets[serve] = (url + "v1/systemone", engine.source)
        app = stack.enter_context(
            servers.app({"BLINK_MODEL": engine.model_id}, log_dir, servers.bench_env(threads), timeout_s=300)
        )  # the same model; nothing else set
        why = app.down or systemone_probe(app.url + "v1/systemone", engine.model_id, workload.warm)
        if why:
            rows.append({"target": own, "skipped": why})
        else:
            targets[own] = (app.url + "v1/systemone", engine.model_id)
        for clients, requests in workload.levels.items():
            for name, (url, model) in targets.items():
                try:
                    row = http_drive(url, model, requests, clients, workload.warm)
                except Exception as exc:  # noqa: BLE001 - the server's failure, reported in its row
                    row = {"skipped": f"{type(exc).__name__}: {exc}"[:300]}
                rows.append({"target": name, "workload": workload.name, "clients": clients, **row})
    return rows


def systemone_probe(url: str, model: str, body: dict) -> str | None:
    """None when the server answers a System One request; else why not (no such route in this blink yet)."""
    import httpx

    try:
        got = httpx.post(url, json={"model": model, **body}, timeout=600)
    except httpx.HTTPError as exc:
        return f"{url} did not answer: {exc}"
    if got.status_code in (404, 405):
        return "this blink's app has no /v1/systemone route"
    if got.status_code != 200:
        return f"{url} answered {got.status_code}: {got.text[:200]}"
    return None
