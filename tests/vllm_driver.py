"""Runs in the vLLM environment (.venv-vllm): one real vLLM engine answers a list of cases and checks what blink
relies on in vLLM itself; tests/test_vllm_real.py compares the answers with the torch engine's in the main one.

    .venv-vllm/bin/python tests/vllm_driver.py CASES.json OUT.json

The engine is the one `BLINK_BACKEND=vllm` builds from the environment's settings (BLINK_DTYPE, BLINK_VLLM_ARGS).
CASES.json is a list of {"name", "kind", "requests": [[state, questions], ...]}, kind one of
- "decide": each request through Deployment.decide, one after another;
- "decide_many": all requests in one Deployment.decide_many call;
- "concurrent": one caller thread per request through the Deployment's Batcher, the first request's generate call
  held until all the others wait in the queue, so the rest are packed into shared calls.
OUT.json: {"facts": what vLLM did, "results": {name: [answer or {"error": ...}, ...]}}.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import blink  # noqa: E402

QUEUE_WAIT_S = 600  # the most the held first call waits for the other callers to queue: a deadline for a hang


class HeldLLM:
    """vllm.LLM whose first generate call waits until `release` is set (every other attribute is the LLM's)."""

    def __init__(self, llm):
        self.llm, self.entered, self.release = llm, threading.Event(), threading.Event()
        self.calls: list[int] = []  # prompts per generate call

    def generate(self, prompts, params, **kwargs):
        self.entered.set()
        self.release.wait(QUEUE_WAIT_S)
        self.calls.append(len(prompts))
        return self.llm.generate(prompts, params, **kwargs)

    def __getattr__(self, name):
        return getattr(self.llm, name)


def live_engine(dep: blink.Deployment) -> blink.VllmEngine:
    """The vLLM engine behind the deployment's default model (the live half of a hybrid)."""
    engine = dep.engine()
    engine = getattr(engine, "live", engine)
    if not isinstance(engine, blink.VllmEngine):
        raise SystemExit(f"the deployment built {type(engine).__name__}, not the vLLM engine: set BLINK_BACKEND=vllm")
    return engine


def wait_for(check, timeout_s: float) -> bool:
    """Poll `check` until it holds or the time is up; its last value."""
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.01)
    return check()


def outcome(call) -> dict:
    """call()'s answer, or its error as {"error": "Type: message"}."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - reported to the test, which says which request failed
        return {"error": f"{type(exc).__name__}: {exc}"}


def concurrent(dep: blink.Deployment, engine: blink.VllmEngine, requests: list) -> list[dict]:
    """One thread per request through the Batcher; the first holds the engine until the rest are queued."""
    held = HeldLLM(engine.llm)
    engine.llm = held
    results: list = [None] * len(requests)

    def call(i: int) -> None:
        results[i] = outcome(lambda: dep.submit(dep.request(*requests[i])))

    try:
        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
        threads[0].start()
        held.entered.wait(QUEUE_WAIT_S)
        for t in threads[1:]:
            t.start()
        queued = wait_for(lambda: dep.batcher().q.qsize() == len(requests) - 1, QUEUE_WAIT_S)
        held.release.set()
        for t in threads:
            t.join(QUEUE_WAIT_S)
    finally:
        engine.llm = held.llm
    return [{**r, "queued_together": queued, "generate_calls": held.calls} if "error" not in r else r for r in results]


def run_case(dep: blink.Deployment, engine: blink.VllmEngine, case: dict) -> list[dict]:
    """One case's answers, in request order."""
    requests = [tuple(r) for r in case["requests"]]
    if case["kind"] == "decide":
        return [outcome(lambda r=r: dep.decide(*r)) for r in requests]
    if case["kind"] == "decide_many":
        return [
            r if isinstance(r, dict) else {"error": f"{type(r).__name__}: {r}"}
            for r in dep.decide_many([list(r) for r in requests])
        ]
    if case["kind"] == "concurrent":
        return concurrent(dep, engine, requests)
    raise SystemExit(f"unknown case kind {case['kind']!r}")


def label_cap(engine: blink.VllmEngine) -> dict:
    """What real vLLM does with VLLM_MAX_LABELS label ids in one request, and with one more."""
    import vllm.sampling_params

    ids = list(range(blink.VLLM_MAX_LABELS + 1))
    prompt = [{"prompt_token_ids": engine.tok("cap")["input_ids"]}]
    out = {"vllm_max_logprob_token_ids": vllm.sampling_params.MAX_LOGPROB_TOKEN_IDS}
    for n in (blink.VLLM_MAX_LABELS, blink.VLLM_MAX_LABELS + 1):
        params = engine.sampling_params(max_tokens=1, temperature=0.0, logprob_token_ids=ids[:n], detokenize=False)
        try:
            (got,) = engine.llm.generate(prompt, [params], use_tqdm=False)
            out[str(n)] = {"returned_ids": sorted(set(got.outputs[0].logprobs[0]) & set(ids[:n]))}
        except Exception as exc:  # noqa: BLE001 - the refusal is the fact recorded
            out[str(n)] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def output_shape(engine: blink.VllmEngine) -> dict:
    """The shape of one RequestOutput for blink's kind of request: what label_logprobs and VllmEngine.read read."""
    ids = engine.tok("shape")["input_ids"]
    labels = engine.label_ids[:3]
    params = engine.sampling_params(max_tokens=1, temperature=0.0, logprob_token_ids=labels, detokenize=False)
    (got,) = engine.llm.generate([{"prompt_token_ids": ids}], [params], use_tqdm=False)
    completion = got.outputs[0]
    position = completion.logprobs[0]
    return {
        "outputs": len(got.outputs),
        "token_ids": list(completion.token_ids),
        "positions": len(completion.logprobs),
        "keys": sorted(position),
        "labels": labels,
        "logprob_type": type(position[labels[0]].logprob).__name__,
        "num_cached_tokens": got.num_cached_tokens,
        "prompt_tokens": len(ids),
    }


def facts(engine: blink.VllmEngine) -> dict:
    """What blink relies on in vLLM, read from the running engine."""
    import vllm

    config = engine.llm.model_config
    return {
        "vllm": vllm.__version__,
        "logprobs_mode": str(config.logprobs_mode),
        "dtype": str(config.dtype),
        "max_model_len": config.max_model_len,
        "max_input_tokens": engine.max_input_tokens,
        "label_cap": label_cap(engine),
        "output_shape": output_shape(engine),
    }


def main(argv: list[str]) -> int:
    """Answer every case on one engine, record the facts, write OUT.json."""
    cases_path, out_path = argv
    with open(cases_path, encoding="utf-8") as fh:
        cases = json.load(fh)
    t0 = time.perf_counter()
    dep = blink.Deployment(blink.env_settings())
    engine = live_engine(dep)
    started = time.perf_counter() - t0
    results = {case["name"]: run_case(dep, engine, case) for case in cases}
    out = {
        "facts": {
            **facts(engine),
            "engine_start_s": round(started, 1),
            "cases_s": round(time.perf_counter() - t0 - started, 1),
        },
        "results": results,
    }
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump(out, fh, ensure_ascii=False)
    return 0


if __name__ == "__main__":  # vLLM starts its engine in a spawned process that imports this file again
    sys.exit(main(sys.argv[1:]))
