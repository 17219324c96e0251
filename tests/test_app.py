"""The Space over the real server: presets from the recording, live requests on the stand-in model, batching, and
every kind of bad input, all through the real gradio_client."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re

import pytest
from conftest import serving
from gradio_client.exceptions import AppError

import blink

NEWS = "News topic (30 categories)"
TICKET = "Support ticket triage"
INCIDENT = "Incident review (multi-label, order-robust, abstain)"


def preset(app, name: str) -> dict:
    """A bundled example by its name."""
    return app.PRESETS[name]


def recording(app) -> blink.Recording:
    """The launched app's recording (replay.json), read from its file."""
    return blink.Recording.load(app.SETTINGS.replay_path)


def recorded_answers(app, state, questions: dict, temperature: float = 1.0) -> dict:
    """The answers the recording's label logits give at one temperature, assembled in process."""
    request = blink.parse_request(state, questions)
    readouts = blink.ReplayEngine(app.SETTINGS.replay_path).forward(request).readouts
    return blink.assemble(request, readouts, dict.fromkeys(questions, temperature))


def n_options(qkey: str, q: dict) -> int:
    """How many options a question offers."""
    return len(blink.parse_question(qkey, q).options)


def assert_distribution(answer: dict, n_options: int) -> None:
    """Every option has a probability and together they sum to one."""
    probs = answer["probabilities"]
    assert len(probs) == n_options
    assert all(0.0 <= p <= 1.0 for p in probs.values())
    assert math.isclose(sum(probs.values()), 1.0, abs_tol=1e-9)


# ------------------------------------------------------------------------------------------------------------------
# Presets and the recording
# ------------------------------------------------------------------------------------------------------------------


def test_presets_cover_types_states_and_sizes(launched):
    app, _ = launched
    examples = list(app.PRESETS.values())
    assert len(examples) >= 6
    types = {q["type"] for ex in examples for q in ex["questions"].values()}
    assert types == {"choice", "noul", "score"}
    assert any(isinstance(ex["state"], dict) for ex in examples)
    assert any(isinstance(ex["state"], str) for ex in examples)
    assert any(n_options(k, q) >= 26 for ex in examples for k, q in ex["questions"].items())
    assert any(len(ex["questions"]) >= 6 and len(blink.text(ex["state"])) >= 2000 for ex in examples)


def test_recording_covers_every_preset_and_names_its_maker(launched):
    app, _ = launched
    rec = recording(app)
    assert rec.model == app.DEPLOYMENT.default_model
    assert rec.hardware and rec.recorded_at
    assert app.DEPLOYMENT.recording().header() == rec.header()
    text_presets = [
        ex for ex in app.PRESETS.values() if not app.DEPLOYMENT.request(ex["state"], ex["questions"]).holds_images()
    ]
    assert len(text_presets) >= 6
    for ex in text_presets:  # an image preset needs a vision model: the text-only stand-in cannot record it
        assert blink.request_key(ex["state"], ex["questions"]) in rec.requests, ex["name"]
        assert rec.has(app.DEPLOYMENT.request(ex["state"], ex["questions"])), ex["name"]


def test_editor_text_gives_back_the_recorded_request(launched):
    """What the page shows for a preset parses back to the very request that was recorded."""
    app, _ = launched
    for ex in app.PRESETS.values():
        state = blink.coerce_state(app.state_text(ex["state"]))
        questions = blink.coerce_questions(app.questions_text(ex["questions"]))
        assert blink.request_key(state, questions) == blink.request_key(ex["state"], ex["questions"]), ex["name"]


def test_recording_is_not_used_for_another_model(launched, tmp_path):
    """A deployment of the app's settings whose recording was made by another model has no recording: its
    presets run live (torch, not hybrid)."""
    app, _ = launched
    other = tmp_path / "replay.json"
    data = json.loads(pathlib.Path(app.SETTINGS.replay_path).read_text())
    other.write_text(json.dumps({**data, "model": "someone/else"}))
    dep = blink.Deployment(dataclasses.replace(app.SETTINGS, replay_path=str(other)))
    assert dep.recording() is None
    assert dep.recording(app.DEPLOYMENT.default_model) is None
    assert dep.engine_kind() == "torch"
    assert app.DEPLOYMENT.recording() is not None  # the served deployment keeps its own


def test_preset_comes_from_the_recording(launched, client):
    app, _ = launched
    ex = preset(app, TICKET)
    got = client.predict(
        app.state_text(ex["state"]), app.questions_text(ex["questions"]), 1.0, "", "saved", api_name="/decide"
    )
    assert got["meta"]["engine"] == "replay"
    assert got["meta"]["recorded_on"] == recording(app).hardware
    assert got["answers"] == json.loads(json.dumps(recorded_answers(app, ex["state"], ex["questions"])))
    for qkey, q in ex["questions"].items():
        assert_distribution(got["answers"][qkey], n_options(qkey, q))


def test_feature_preset_comes_from_the_recording_with_label_mass(launched, client):
    """The multi-label / permute / abstain preset is recorded with each prompt's vocabulary log-sum-exp, so its
    answers carry label mass; multi, rotations and abstention are read from the recorded numbers."""
    app, _ = launched
    ex = preset(app, INCIDENT)
    qs = ex["questions"]
    entry = recording(app).requests[blink.request_key(ex["state"], qs)]
    assert {qkey: len(v) for qkey, v in entry["lse"].items()} == {
        qkey: len(blink.parse_question(qkey, q).rows) for qkey, q in qs.items()
    }
    got = client.predict(app.state_text(ex["state"]), app.questions_text(qs), 1.0, "", "saved", api_name="/decide")
    assert got["meta"]["engine"] == "replay"
    assert (got["meta"]["temperature"], got["meta"]["temperature_source"]) == (1.0, "request")
    assert got["answers"] == json.loads(json.dumps(recorded_answers(app, ex["state"], qs)))
    for answer in got["answers"].values():
        assert answer["label_mass"] is not None and 0.0 < answer["label_mass"] <= 1.0
    multi = got["answers"]["contributing_factors"]
    assert multi["multi"] is True and list(multi["probabilities"]) == list(qs["contributing_factors"]["criteria"])
    assert multi["choices"] == [k for k, p in multi["probabilities"].items() if p > 0.5]
    severity = got["answers"]["severity"]
    assert severity["rotations"] == 3 and len(severity["rotation_choices"]) == 3
    assert_distribution(severity, 4)
    for qkey in ("refunds_owed", "root_cause_clear"):
        answer, rule = got["answers"][qkey], qs[qkey]["abstain"]
        short = answer["label_mass"] < rule.get("min_label_mass", 0) or answer["confidence"] < rule.get(
            "min_confidence", 0
        )
        assert answer["abstained"] is short and (answer["noul"] is None) is short and ("reason" in answer) is short


def test_recording_matches_the_live_model(launched, client):
    """The preset's recorded numbers are what the served model computes now (30 options, every one shown)."""
    app, _ = launched
    ex = preset(app, NEWS)
    saved = client.predict(ex["state"], ex["questions"], 0.7, "", "saved", api_name="/decide")
    live = client.predict(ex["state"], ex["questions"], 0.7, "", "live", api_name="/decide")
    assert (saved["meta"]["engine"], live["meta"]["engine"]) == ("replay", "torch")
    a, b = saved["answers"]["topic"], live["answers"]["topic"]
    assert_distribution(b, 30)
    assert a["choice"] == b["choice"]
    assert max(abs(a["probabilities"][k] - b["probabilities"][k]) for k in a["probabilities"]) < 1e-4


# ------------------------------------------------------------------------------------------------------------------
# Live requests and batching
# ------------------------------------------------------------------------------------------------------------------


def test_edited_request_runs_live(launched, client):
    app, _ = launched
    ex = preset(app, "Product review sentiment")
    edited = ex["state"].replace("Returning it.", "Still, I am keeping it.")
    got = client.predict(edited, json.dumps(ex["questions"]), 1.0, "", "saved", api_name="/decide")
    meta = got["meta"]
    assert meta["engine"] == "torch" and meta["model"] == app.DEPLOYMENT.default_model
    live = app.DEPLOYMENT.engine().live
    prompts = live.render(app.DEPLOYMENT.request(edited, ex["questions"]))  # every prompt the model read, in process
    assert meta["generated_tokens"] == 0 and meta["input_tokens"] == sum(len(p.ids) for p in prompts)
    assert meta["model_ms"] > 0
    assert meta["batched_requests"] == 1  # the only request in flight: it shared its forwards with none
    assert (meta["backend"], meta["dtype"], meta["cpu_matmul"]) == ("torch", "float32", live.matmul)  # conftest pins
    assert "fabricated" not in meta
    assert list(got["answers"]) == list(ex["questions"])
    sentiment = got["answers"]["sentiment"]
    assert_distribution(sentiment, 5)
    assert sentiment["legend"] == {str(i): level for i, level in enumerate(ex["questions"]["sentiment"]["criteria"])}
    want = app.DEPLOYMENT.decide(edited, ex["questions"])["answers"]  # the same request, in process
    assert abs(sentiment["score"] - want["sentiment"]["score"]) < 1e-4
    assert abs(got["answers"]["will_return"]["noul"] - want["will_return"]["noul"]) < 1e-5


def test_abstained_answers_keep_their_distribution(launched, client):
    """Thresholds out of reach abstain every type (no pick, a reason, the distribution kept); a zero one never."""
    app, _ = launched
    qs = {
        "urgent": {"type": "noul", "instructions": "Is this urgent?", "abstain": {"min_label_mass": 1.0}},
        "size": {"type": "score", "criteria": ["small", "medium", "large"], "abstain": {"min_confidence": 1.0}},
        "team": {"type": "choice", "criteria": ["billing", "access"], "abstain": {"min_confidence": 0.0}},
    }
    state = "Card charged twice, please refund."
    got = client.predict(state, qs, api_name="/decide")["answers"]
    urgent, size, team = got["urgent"], got["size"], got["team"]
    assert urgent["abstained"] is True and urgent["noul"] is None and "below min_label_mass 1" in urgent["reason"]
    assert size["abstained"] is True and size["score"] is None and size["choice"] is None
    assert "below min_confidence 1" in size["reason"]
    assert_distribution(urgent, 2)
    assert_distribution(size, 3)
    assert team["abstained"] is False and team["choice"] in ("billing", "access") and "reason" not in team
    html = app.render_answers(app.DEPLOYMENT.request(state, qs), {"answers": got})
    assert html.count('class="bk-card bk-abstained"') == 2 and html.count(">Abstained</span>") == 2
    assert html.count('class="bk-reason"') == 2 and html.count(">no pick</b>") == 2


def test_multi_and_permute_answers(launched, client):
    """A multi question gives independent p(yes) per option; a permuted one averages its rotations."""
    app, _ = launched
    qs = {
        "issues": {
            "type": "choice",
            "multi": True,
            "instructions": "Which problems does the customer report?",
            "criteria": ["double charge", "cannot log in", "slow delivery"],
        },
        "team": {"type": "choice", "permute": 2, "criteria": ["billing", "access", "shipping"]},
    }
    state = "I was charged twice and now my login fails."
    got = client.predict(state, qs, api_name="/decide")["answers"]
    issues, team = got["issues"], got["team"]
    p = issues["probabilities"]
    assert issues["multi"] is True and list(p) == qs["issues"]["criteria"] and all(0 < v < 1 for v in p.values())
    assert issues["choices"] == [k for k, v in p.items() if v > 0.5]
    assert issues["confidence"] == pytest.approx(min(abs(2 * v - 1) for v in p.values()))
    # the two rotations (shifts 0 and 1 of the 3 options in key order) asked as plain choices: the permuted answer is
    # their average
    options = sorted(qs["team"]["criteria"])
    assert options != qs["team"]["criteria"]  # key order is not the listed order here
    rotated = app.DEPLOYMENT.decide(
        state, {f"r{s}": {"type": "choice", "criteria": options[s:] + options[:s]} for s in (0, 1)}
    )["answers"]
    dists = [rotated[f"r{s}"]["probabilities"] for s in (0, 1)]
    assert team["rotations"] == 2 and team["rotation_choices"] == [max(d, key=d.get) for d in dists]
    assert team["probabilities"] == pytest.approx({k: (dists[0][k] + dists[1][k]) / 2 for k in options}, abs=1e-5)
    mean = {k: (dists[0][k] + dists[1][k]) / 2 for k in options}  # the mean total-variation distance from the average
    spread = sum(0.5 * sum(abs(d[k] - mean[k]) for k in options) for d in dists) / len(dists)
    assert team["order_sensitivity"] == pytest.approx(spread, abs=1e-5)
    assert_distribution(team, 3)
    assert all(0.0 < a["label_mass"] <= 1.0 for a in got.values())
    html = app.render_answers(app.DEPLOYMENT.request(state, qs), {"answers": got})
    assert html.count('role="checkbox"') == 3 and html.count('aria-checked="true"') == len(issues["choices"])
    assert 'data-rotations="2"' in html and html.count('class="bk-rot"') == 2


def test_concurrent_requests_share_forward_passes(launched, client):
    """The queue lets several /decide calls run at once, so the Batcher packs them into the same forwards."""
    questions = {"urgent": {"type": "noul", "instructions": "Is this message urgent?"}}
    jobs = [
        client.submit(f"Message {i}: the server room is flooding, please come now.", questions, api_name="/decide")
        for i in range(6)
    ]
    results = [job.result(timeout=120) for job in jobs]
    assert all(r["meta"]["engine"] == "torch" for r in results)
    assert max(r["meta"]["batched_requests"] for r in results) > 1
    alone = client.predict("Message 5: the server room is flooding, please come now.", questions, api_name="/decide")
    assert abs(alone["answers"]["urgent"]["noul"] - results[5]["answers"]["urgent"]["noul"]) < 1e-4


def test_batch_endpoint_answers_each_request_in_place(launched, client):
    questions = {
        "spam": {"type": "noul", "instructions": "Is this message spam?"},
        "lang": {"type": "choice", "criteria": ["English", "French", "German"]},
    }
    requests = [
        {"state": "WIN A FREE CRUISE!!! Click now", "questions": questions},
        {"state": "Bonjour, je voudrais réserver une table.", "questions": {"bad": {"type": "maybe"}}},
        {"state": {"from": "boss", "text": "Meeting moved to 3pm"}, "questions": json.dumps(questions)},
    ]
    got = client.predict(requests, 1.0, "", api_name="/decide_batch")
    assert len(got) == 3
    assert got[1]["loc"] == ["body", "requests", 1, "questions", "bad", "type"]
    assert "type must be one of choice, noul, score" in got[1]["error"]
    for item in (got[0], got[2]):
        assert item["meta"]["engine"] == "torch"
        assert_distribution(item["answers"]["lang"], 3)
    alone = client.predict(requests[2]["state"], questions, api_name="/decide")
    assert abs(alone["answers"]["spam"]["noul"] - got[2]["answers"]["spam"]["noul"]) < 1e-4


def test_info_lists_models_and_presets(launched, client):
    app, _ = launched
    got = client.predict(api_name="/info")
    default = app.DEPLOYMENT.default_model
    assert got["default_model"] == default and got["models"] == app.DEPLOYMENT.models() == [default]
    assert [p["name"] for p in got["presets"]] == list(app.PRESETS)
    assert got["recordings"][default]["model"] == default
    assert got["recordings"][default] == recording(app).header()
    compute = got["compute"][default]  # what computes the live model, the kernel verdict with it
    assert compute == json.loads(json.dumps(app.DEPLOYMENT.engine().live.compute))
    assert compute["backend"] == "torch" and compute["cpu_matmul"] in ("onednn", "torch")


def test_only_the_api_endpoints_are_public(client):
    endpoints = set(client.view_api(print_info=False, return_format="dict")["named_endpoints"])
    assert endpoints == {"/decide", "/decide_batch", "/info"}


# ------------------------------------------------------------------------------------------------------------------
# Bad input: a clear message naming the field, never a traceback
# ------------------------------------------------------------------------------------------------------------------

OK_Q = {"q": {"type": "noul"}}
BAD_DECIDE = [
    (("", OK_Q), "state is empty", "state"),
    (("[" * 5000, OK_Q), "state nests too deep to read", "state"),  # JSON-looking, too deep: refused, not text
    (('{"n": ' + "1" * 5000 + "}", OK_Q), "state cannot be read", "state"),  # an integer Python will not convert
    (("x", "{not json"), "questions is not valid JSON", "questions"),
    (("x", ""), "questions is empty", "questions"),
    (("x", "[1, 2]"), "questions must be a non-empty object", "questions"),
    (("x", {}), "questions must be a non-empty object", "questions"),
    (("x", {"q": "yes?"}), "must be an object with type and criteria", "questions.q"),
    (("x", {"q": {"type": "rank"}}), "type must be one of choice, noul, score", "questions.q.type"),
    (("x", {"q": {"type": ["noul"]}}), "type must be one of choice, noul, score", "questions.q.type"),
    (("x", {"q": {"type": {"noul": 1}}}), "type must be one of choice, noul, score", "questions.q.type"),
    (("x", {"q": {"type": "choice"}}), "a choice needs criteria", "questions.q.criteria"),
    (
        ("x", {"q": {"type": "choice", "criteria": [str(i) for i in range(256)]}}),
        "256 options; supported 1-255",
        "questions.q.criteria",
    ),
    (("x", {"q": {"type": "choice", "criteria": ["a", "a"]}}), "duplicate option keys", "questions.q.criteria"),
    (("x", {"q": {"type": "score", "criteria": ["only one"]}}), "2 to 10 levels", "questions.q.criteria"),
    (("x", {"q": {"type": "noul", "criteria": "yes"}}), "noul criteria must be an object", "questions.q.criteria"),
    (("x", OK_Q, 0.0), "temperature must be a finite number above 0", "temperature"),
    (("x", OK_Q, -1.5), "temperature must be a finite number above 0", "temperature"),
    (("x", OK_Q, 1.0, "nobody/nothing"), "unknown model 'nobody/nothing'", "model"),
    (("x", OK_Q, 1.0, "", "maybe"), "prefer must be 'live' or 'saved'", "prefer"),
]


@pytest.mark.parametrize("args,message,field", BAD_DECIDE, ids=[c[1] for c in BAD_DECIDE])
def test_bad_decide_input_is_a_clear_error(client, args, message, field):
    with pytest.raises(AppError) as err:
        client.predict(*args, api_name="/decide")
    text = str(err.value)
    assert message in text and f"(field: {field})" in text
    assert "Traceback" not in text


BAD_BATCH = [
    (("not json",), "requests is not valid JSON"),
    (([],), "requests must be a non-empty list"),
    (([{"state": "x", "questions": OK_Q}] * 65,), "65 requests; one call takes 1-64"),
    (([{"state": "x", "questions": OK_Q}], 0.0), "temperature must be a finite number above 0"),
    (([{"state": "x", "questions": OK_Q}], 1.0, "nobody/nothing"), "unknown model"),
]


@pytest.mark.parametrize("args,message", BAD_BATCH, ids=[c[1] for c in BAD_BATCH])
def test_bad_batch_call_is_a_clear_error(client, args, message):
    with pytest.raises(AppError, match=message):
        client.predict(*args, api_name="/decide_batch")


def test_bad_batch_items_are_reported_in_place(client):
    got = client.predict([{"state": "x"}, {"state": "", "questions": OK_Q}, "nope"], api_name="/decide_batch")
    assert [g["loc"] for g in got] == [
        ["body", "requests", 0],
        ["body", "requests", 1, "state"],
        ["body", "requests", 2],
    ]
    assert "state and questions" in got[0]["error"] and "state is empty" in got[1]["error"]


# ------------------------------------------------------------------------------------------------------------------
# Other engines: fabricated numbers are labelled; a replay-only host explains a miss
# ------------------------------------------------------------------------------------------------------------------


def test_mock_numbers_are_labelled_fabricated(launched, client):
    app, _ = launched
    with serving(app, blink.MockEngine(app.DEPLOYMENT.default_model, app.SETTINGS)):
        got = client.predict("The invoice is overdue.", OK_Q, api_name="/decide")
        page = app.ui_result("The invoice is overdue.", json.dumps(OK_Q), 1.0, None)
    assert got["meta"]["engine"] == "mock" and got["meta"]["fabricated"] is True
    assert "fabricated" in got["meta"]["notice"]
    assert 'class="bk-notice bk-fabricated"' in page[0] and "fabricated" in page[0]
    with serving(app, blink.MockEngine(app.DEPLOYMENT.default_model, app.SETTINGS)):
        broken = app.ui_result('{"ticket": 1,', json.dumps(OK_Q), 1.0, None)
    assert "does not parse, so it was read as text" in broken[0]
    deep = app.ui_result("[" * 5000, json.dumps(OK_Q), 1.0, None)  # too deep to read: refused, not read as text
    assert 'class="bk-notice bk-error"' in deep[0] and "(field: state)" in deep[0] and "read as text" not in deep[0]


def test_replay_only_host_explains_a_miss(launched, client):
    app, _ = launched
    ex = preset(app, TICKET)
    with serving(
        app, blink.ReplayEngine(app.SETTINGS.replay_path, model_id=app.DEPLOYMENT.default_model, settings=app.SETTINGS)
    ):
        hit = client.predict(ex["state"], ex["questions"], api_name="/decide")
        with pytest.raises(AppError, match="only has saved runs for the built-in examples"):
            client.predict("an edited ticket", ex["questions"], api_name="/decide")
        meta_html, answers_html, raw = app.ui_result("an edited ticket", json.dumps(ex["questions"]), 1.0, None)
    assert hit["meta"]["engine"] == "replay"
    assert 'class="bk-notice bk-miss"' in meta_html and "saved runs" in meta_html and answers_html == ""
    assert "saved runs" in json.loads(raw)["error"]


# ------------------------------------------------------------------------------------------------------------------
# The page's pieces: the add-a-question form and the rendering
# ------------------------------------------------------------------------------------------------------------------


def test_form_adds_each_type_of_question(launched):
    app, _ = launched
    text = app.build_question("", "team", "choice", "Which team?", "billing: money\naccess: logins")
    text = app.build_question(text, "urgent", "noul", "Is it urgent?", "yes: blocked today")
    text = app.build_question(text, "size", "score", "How big?", "small\nmedium\nlarge")
    got = json.loads(text)
    assert got == {
        "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "money", "access": "logins"}},
        "urgent": {"type": "noul", "instructions": "Is it urgent?", "criteria": {"true": "blocked today"}},
        "size": {"type": "score", "instructions": "How big?", "criteria": ["small", "medium", "large"]},
    }


@pytest.mark.parametrize(
    "args,message",
    [
        (("{}", "", "noul", "", ""), "give the new question a name"),
        (('{"a": {"type": "noul"}}', "a", "noul", "", ""), "already exists"),
        (("{oops", "b", "noul", "", ""), "fix the questions JSON first"),
        (("", "b", "choice", "", "only"), "at least two options"),
        (("", "b", "score", "", "one"), "2 to 10 levels"),
    ],
)
def test_form_refuses_mistakes(launched, args, message):
    import gradio as gr

    app, _ = launched
    with pytest.raises(gr.Error, match=message):
        app.build_question(*args)


def test_form_writes_the_opt_in_fields_only_when_set(launched):
    app, _ = launched
    text = app.build_question("", "tags", "choice", "Which apply?", "late\ndamaged", None, True, None, 0.2)
    text = app.build_question(text, "team", "choice", "", "billing\naccess\nbug", 3.0, False, 0.5, None)
    text = app.build_question(text, "urgent", "noul", "", "", None, False, 0.25, 0.5)
    text = app.build_question(text, "plain", "choice", "", "a\nb")
    text = app.build_question(text, "zeros", "choice", "", "a\nb", 0, False, 0, 0.0)  # what the page sends when unset
    got = json.loads(text)
    assert got["tags"] == {
        "type": "choice",
        "instructions": "Which apply?",
        "criteria": ["late", "damaged"],
        "multi": True,
        "abstain": {"min_confidence": 0.2},
    }
    assert got["team"]["permute"] == 3 and isinstance(got["team"]["permute"], int)
    assert got["team"]["abstain"] == {"min_label_mass": 0.5} and "multi" not in got["team"]
    assert got["urgent"]["abstain"] == {"min_label_mass": 0.25, "min_confidence": 0.5}
    assert set(got["plain"]) == set(got["zeros"]) == {"type", "instructions", "criteria"}
    blink.parse_questions(got)


@pytest.mark.parametrize(
    "extras,message",
    [
        (("noul", 2, False, None, None), "permute applies to choice questions only"),
        (("choice", 2, True, None, None), "multi and permute cannot be combined"),
        (("choice", 4, False, None, None), "from 1 to its 3 options"),
        (("choice", None, False, 1.5, None), "abstain.min_label_mass must be a number from 0 to 1"),
        (("score", None, True, None, None), "multi applies to choice questions only"),
    ],
)
def test_form_refuses_bad_opt_in_fields(launched, extras, message):
    import gradio as gr

    app, _ = launched
    qtype, *rest = extras
    with pytest.raises(gr.Error, match=message):
        app.build_question("", "q", qtype, "", "a\nb\nc", *rest)


def test_permute_and_multi_controls_follow_the_type(launched):
    app, _ = launched
    shown = app.choice_only_controls("choice")
    hidden = app.choice_only_controls("score")
    assert [u["visible"] for u in shown] == [True, True] and all("value" not in u for u in shown)
    assert [(u["visible"], u["value"]) for u in hidden] == [(False, 0), (False, False)]


def test_rendering_shows_every_option(launched):
    app, _ = launched
    q = blink.parse_request("x", {"pick": {"type": "choice", "criteria": [f"label {i}" for i in range(40)]}})
    probs = [1.0 / 40] * 40
    result = {
        "answers": blink.assemble(q, {"pick": blink.Readout([[math.log(p) for p in probs]], [None])}, {"pick": 1.0})
    }
    html = app.render_answers(q, result)
    assert html.count('class="bk-row') == 40
    hostile = blink.parse_request("x", {"<script>": {"type": "noul"}})
    assert "<script" not in app.render_answers(
        hostile,
        {"answers": blink.assemble(hostile, {"<script>": blink.Readout([[0.0, 0.0]], [None])}, {"<script>": 1.0})},
    )


MOCK_QS = {
    "tags": {"type": "choice", "multi": True, "criteria": ["late", "damaged", "wrong item"]},
    "tags_unsure": {
        "type": "choice",
        "multi": True,
        "criteria": ["late", "damaged"],
        "abstain": {"min_confidence": 1.0},
    },
    "intent": {"type": "choice", "permute": 3, "criteria": ["refund", "exchange", "complaint"]},
    "upset": {"type": "noul", "abstain": {"min_label_mass": 1.0}},
    "stars": {"type": "score", "criteria": ["1", "2", "3", "4", "5"], "abstain": {"min_confidence": 1.0}},
    "kept": {"type": "choice", "criteria": ["a", "b"], "abstain": {"min_confidence": 0.0}},
}


def test_rendering_of_multi_abstained_and_permuted_answers(launched):
    """Cards for the mock engine's (fabricated) multi, permuted and abstained answers: badges, chips, checklist."""
    app, _ = launched
    state = "The parcel came two weeks late and the box was crushed; I want my money back."
    request = blink.parse_request(state, MOCK_QS)
    raw = blink.MockEngine("org/mock").forward(request).readouts
    answers = blink.assemble(request, raw, dict.fromkeys(MOCK_QS, 1.0))
    html = app.render_answers(request, {"answers": answers})
    cards = {re.search(r'data-question="(\w+)"', part).group(1): part for part in html.split('<div class="bk-card')[1:]}
    assert list(cards) == list(MOCK_QS)
    for qkey, answer in answers.items():
        card, abstained = cards[qkey], answer.get("abstained", False)
        assert f">on-label {app.pct(answer['label_mass'])}</span>" in card
        assert (">Abstained</span>" in card) is abstained and card.startswith(' bk-abstained"') is abstained, qkey
    assert [answers[k].get("abstained") for k in MOCK_QS] == [None, True, None, True, True, False]
    assert cards["tags"].count('role="checkbox"') == 3
    assert cards["tags"].count('aria-checked="true"') == len(answers["tags"]["choices"])
    assert cards["tags_unsure"].count('aria-checked="true"') == 0 and "no pick" in cards["tags_unsure"]
    intent = answers["intent"]
    assert f"order sensitivity <b>{intent['order_sensitivity']:.2f}</b> · 3 rotation(s)" in cards["intent"]
    assert re.findall(r'class="bk-rot">(\w+)<', cards["intent"]) == intent["rotation_choices"]
    assert 'role="meter"' in cards["upset"] and "leans" not in cards["upset"]
    assert "bk-scale-marker" not in cards["stars"] and cards["stars"].count('class="bk-row') == 5


def test_on_label_badge_warns_below_half_and_says_when_unknown(launched):
    app, _ = launched
    q = blink.parse_request("x", {"q": {"type": "choice", "criteria": ["x", "y"]}})
    row = [1.0, 0.0]

    def badge(mass):
        lse = None if mass is None else blink.logsumexp(row) - math.log(mass)
        answers = blink.assemble(q, {"q": blink.Readout([row], [lse])}, {"q": 1.0})
        return re.search(
            r'<span class="(bk-badge bk-mass[^"]*)"[^>]*>([^<]*)<', app.render_answers(q, {"answers": answers})
        ).groups()

    assert badge(0.3) == ("bk-badge bk-mass bk-mass-low", "on-label 30.0%")
    assert badge(0.8) == ("bk-badge bk-mass", "on-label 80.0%")
    assert badge(None) == ("bk-badge bk-mass bk-mass-na", "on-label n/a")


def test_meta_line_names_the_temperature_source(launched, tmp_path):
    app, _ = launched
    model = app.DEPLOYMENT.default_model
    path = tmp_path / "calibration.json"
    path.write_text(
        json.dumps({"format": blink.CALIBRATION_FORMAT, "models": {model: {"temperatures": {"choice:3-4": 2.0}}}})
    )
    settings = dataclasses.replace(app.SETTINGS, calibration_path=str(path))
    qs = {
        "intent": MOCK_QS["intent"],
        "upset": {"type": "noul"},
        "tags": MOCK_QS["tags"],
        "more": {"type": "noul"},
        "again": {"type": "noul"},
        "last": {"type": "noul"},
    }
    dep = blink.Deployment.serving(blink.MockEngine(model, settings), settings)
    mixed = dep.decide("x", qs)["meta"]
    asked = dep.decide("x", qs, temperature=0.5)["meta"]
    assert mixed["temperature"] == {"intent": 2.0, **dict.fromkeys(list(qs)[1:], 1.0)}
    line = app.render_meta(mixed)
    assert "T = 2 (calibration calibration.json) for intent; 1 (default) for upset, tags, more +2" in line
    assert f'title="2 (calibration:{path}) for intent; 1 (default) for upset, tags, more, again, last"' in line
    assert "T = 0.5 (request)</div>" in app.render_meta(asked)


# ------------------------------------------------------------------------------------------------------------------
# ZeroGPU readiness
# ------------------------------------------------------------------------------------------------------------------


def test_spaces_comes_before_torch_and_weights_load_at_start():
    """`import spaces` precedes anything that can touch CUDA; importing the app builds no engine, starting it (what
    launch does, before the server runs) builds them all (weights placed at start, as ZeroGPU wants)."""
    import os
    import subprocess
    import sys

    # after start() no engine may be built any more: engine() must hand back the one start() built
    probe = (
        "import sys, app, blink; m = list(sys.modules); at_import = len(blink._LIVE)\n"
        "app.built_demo()\n"
        "def late(*args, **kwargs):\n    raise AssertionError('the engine was not built at start')\n"
        "blink.TorchEngine.__init__ = late\n"
        "live = app.DEPLOYMENT.engine().live\n"
        "print(m.index('spaces') < m.index('torch'), at_import, isinstance(live, blink.TorchEngine), "
        "type(live.model).__name__)"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-4:] == ["True", "0", "True", "LlamaForCausalLM"]


def test_gpu_reservation_fits_the_work(launched):
    app, _ = launched
    eng = app.DEPLOYMENT.engine()
    key = eng.live.key  # the served live model, whose settings cap the reservation
    # docs/security.md: "10 + 1 per 5,000 prompt tokens", at most BLINK_GPU_DURATION
    small = blink._gpu_seconds(key, [[1] * 200] * 4, [[1, 2]] * 4)  # 800 tokens: 10 + 1
    middle = blink._gpu_seconds(key, [[1] * 5_000] * 4, [[1, 2]] * 4)  # 20,000 tokens: 10 + 4
    large = blink._gpu_seconds(key, [[1] * 100_000] * 8, [[1, 2]] * 8)  # 800,000 tokens: 10 + 160, capped
    assert (small, middle) == (11, 14)
    assert large == app.SETTINGS.gpu_duration < 170


def test_an_api_call_without_a_temperature_gets_the_deployments_own(launched, client):
    """Gradio's API sends no temperature unless the caller gives one: calibration (or the default) applies, as on
    /v1/systemone and decide()."""
    app, _ = launched
    with serving(app, blink.MockEngine(app.DEPLOYMENT.default_model, app.SETTINGS)):
        plain = client.predict("x", {"q": {"type": "noul"}}, api_name="/decide")["meta"]
        asked = client.predict("x", {"q": {"type": "noul"}}, 0.5, api_name="/decide")["meta"]
        (batch,) = client.predict([{"state": "x", "questions": {"q": {"type": "noul"}}}], api_name="/decide_batch")
    assert (plain["temperature"], plain["temperature_source"]) == (app.SETTINGS.temperature, "default")
    assert (asked["temperature"], asked["temperature_source"]) == (0.5, "request")
    assert batch["meta"]["temperature_source"] == "default"
