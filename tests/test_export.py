"""`python blink.py export DIR`: under the exported DecisionConfig, transformers' own decision code renders blink's
prompt token for token (prepare_inputs) and answers with blink's probabilities (pipeline("decision")), on the stand-in
(ChatML) and on the tiny Qwen3.5 (its template with the empty think block)."""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import systemone_requests as gen
from conftest import DEFAULTS
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
from transformers.decision import DecisionConfig, parse_questions
from transformers.decision.template_utils import label_token_ids

import blink
from adapters import export

MODELS = {"standin": 200, "tiny_qwen": 300}  # engine fixture -> generated requests compared on it


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """export(model) -> the folder its decision.json and decision_template.jinja were written to (once per model)."""
    folders = {}

    def folder(engine: blink.PromptEngine) -> str:
        if engine.model_id not in folders:
            out = tmp_path_factory.mktemp("export") / "decision"
            done = export.export(str(out), engine.model_id, DEFAULTS)
            assert done["files"] == ["decision.json", "decision_serve.json", "decision_template.jinja"]
            folders[engine.model_id] = str(out)
        return folders[engine.model_id]

    return folder


def theirs_and_ours(engine: blink.PromptEngine, config: DecisionConfig, tok, req: dict) -> list[tuple]:
    """(transformers' inputs and question, blink's prompt) per question of one request."""
    ours = engine.render(blink.parse_request(req["state"], req["questions"], settings=DEFAULTS))
    theirs = config.prepare_inputs(req, tok)
    assert len(theirs) == len(ours)
    return [(inputs, question, prompt) for (inputs, (question,)), prompt in zip(theirs, ours)]


@pytest.mark.parametrize("name", MODELS)
def test_prepare_inputs_gives_blinks_token_ids(name, request, exported):
    engine = request.getfixturevalue(name)
    config = DecisionConfig.from_pretrained(exported(engine))
    tok = copy.deepcopy(engine.tok)  # prepare_inputs adds its sentinel tokens to the tokenizer it is given
    seen = {
        "prompts": 0,
        "noul one-sided": 0,
        "structured": 0,
        "generic": 0,
        "over 26 options": 0,
        "json state": 0,
        "score": 0,
    }
    for req in gen.requests(MODELS[name], seed=12):
        seen["json state"] += not isinstance(req["state"], str)
        for inputs, question, prompt in theirs_and_ours(engine, config, tok, req):
            assert question.name == prompt.qkey
            assert inputs["input_ids"][0].tolist() == prompt.ids, (req, question.name)
            assert int(inputs["marks"][0]) == len(prompt.ids)  # read right after the generation prompt, as blink
            assert label_token_ids(tok, tuple(question.labels)) == prompt.cand  # the same label tokens are read
            spec = req["questions"][question.name]
            crit = spec.get("criteria")
            seen["prompts"] += 1
            seen["score"] += spec["type"] == "score"
            seen["noul one-sided"] += spec["type"] == "noul" and isinstance(crit, dict) and len(crit) == 1
            seen["structured"] += any(isinstance(d, (dict, list)) for d in question.descriptions)
            seen["generic"] += spec["type"] == "choice" and any(k in gen.GENERIC_KEYS for k in crit)
            seen["over 26 options"] += len(question.options) > 26
    assert seen["prompts"] >= 400 and min(seen.values()) >= 5, seen
    think = engine.tok("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    assert (prompt.ids[-len(think) :] == think) == (name == "tiny_qwen")  # Qwen's empty think block, not ChatML's


@pytest.mark.parametrize("name", MODELS)
def test_every_key_kind_and_all_255_labels_render_the_same(name, request, exported):
    loaded = request.getfixturevalue(name)
    engine = blink.PromptEngine(loaded.model_id, None, DEFAULTS)  # the tokenizer alone: no context-length cap
    folder = exported(loaded)
    config, tok = DecisionConfig.from_pretrained(folder), copy.deepcopy(engine.tok)
    keys = {"type": "choice", "instructions": "Which?", "criteria": {k: "d" for k in gen.GENERIC_KEYS + gen.NAMED_KEYS}}
    widest = {"type": "choice", "criteria": {f"k{i}": None for i in range(len(engine.labels))}}
    req = {"state": "x", "questions": {"keys": keys, "widest": widest}}
    pairs = theirs_and_ours(engine, config, tok, req)
    assert all(inputs["input_ids"][0].tolist() == prompt.ids for inputs, _, prompt in pairs)
    assert len(engine.labels) == blink.MAX_OPTIONS and pairs[1][2].cand == engine.label_ids
    with open(os.path.join(folder, "decision.json"), encoding="utf-8") as fh:
        saved = json.load(fh)
    assert saved["labels"] == {"choice": engine.labels, "score": engine.labels[:10], "noul": ["A", "B"]}
    assert saved["noul_options"] == ["true", "false"] and saved["sanitize_control_tokens"] is False
    assert saved["temperature"] == {"choice": 1.0, "noul": 1.0, "score": 1.0}
    too_many = {"type": "choice", "criteria": {f"k{i}": None for i in range(len(engine.labels) + 1)}}
    with pytest.raises(ValueError, match="at most 255 options"):
        config.prepare_inputs({"state": "x", "questions": {"q": too_many}}, tok)
    with pytest.raises(blink.BlinkError, match="supported 1-255"):
        blink.parse_request("x", {"q": too_many}, settings=DEFAULTS)
    # transformers serve reads one JSON file: the same config with the template inside
    assert DecisionConfig.from_file(os.path.join(folder, "decision_serve.json")) == config


# A chat template written to stress the join: it opens with a tag that lstrip_blocks and trim_blocks act on, reads
# `messages` inside a macro and backwards through a namespace, uses names the exported rules use themselves (ns, s,
# d, text) and writes its turns as literal text between tags.
KNOTTY_TEMPLATE = """  {% set text = "unused" %}
{%- macro turns(ns) %}{{ messages|length }}{% endmacro %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages[::-1] %}
  {%- if ns.last_user < 0 and m.role == "user" %}{% set ns.last_user = messages|length - 1 - loop.index0 %}{% endif %}
{%- endfor %}
{% for m in messages %}
<|im_start|>{{ m.role }}
{{ m.content|trim if m.content is string else raise_exception("text only") }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}
"""


def test_the_models_own_template_runs_unchanged_inside_the_export(tmp_path, tiny_qwen_dir):
    model = tmp_path / "knotty"
    shutil.copytree(tiny_qwen_dir, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = KNOTTY_TEMPLATE
    tok.save_pretrained(model)
    engine = blink.PromptEngine(str(model), None, DEFAULTS)
    assert engine.tok.get_chat_template() == KNOTTY_TEMPLATE
    assert blink.wrap(engine.tok, "u").startswith("<|im_start|>system\nApply")  # its own shape, not ChatML's
    folder = tmp_path / "dec"
    export.export(str(folder), str(model), DEFAULTS)
    config, tok = DecisionConfig.from_pretrained(folder), copy.deepcopy(engine.tok)
    for req in gen.requests(60, seed=4):
        for inputs, _, prompt in theirs_and_ours(engine, config, tok, req):
            assert inputs["input_ids"][0].tolist() == prompt.ids


def repo_with_export(tmp_path, engine: blink.PromptEngine, folder: str) -> str:
    """A model folder as a repository would ship it: the model's files and the two exported files."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in os.listdir(engine.source):
        os.symlink(os.path.join(engine.source, name), repo / name)
    for name in ("decision.json", "decision_template.jinja"):
        shutil.copy(os.path.join(folder, name), repo / name)
    return str(repo)


@pytest.mark.parametrize("name", MODELS)
def test_pipeline_answers_with_blinks_probabilities(name, request, exported, served, tmp_path):
    engine = request.getfixturevalue(name)
    repo = repo_with_export(tmp_path, engine, exported(engine))
    if name == "standin":
        decide = pipeline("decision", model=repo, device="cpu")  # the repository's two files are picked up
    else:  # pipeline("decision", model=<a Qwen3.5 repo id>) loads transformers' JEV decision head instead
        decide = pipeline(
            "decision",
            model=AutoModelForCausalLM.from_pretrained(repo),
            tokenizer=AutoTokenizer.from_pretrained(repo),
            device="cpu",
        )
    assert decide.model.dtype == engine.model.dtype == blink.torch_dtype(DEFAULTS)  # float32
    dep, worst, compared = served(engine), 0.0, 0
    for req in gen.requests(8, seed=3, max_options=12):
        theirs = decide(req)
        ours = dep.decide(req["state"], req["questions"])["answers"]
        for key, answer in ours.items():
            got = theirs[key]
            if answer["type"] == "noul":
                gaps = [answer["noul"] - got["noul"]]
            else:
                gaps = [answer["probabilities"][o] - got["probabilities"][o] for o in answer["probabilities"]]
                assert answer["type"] != "choice" or got["choice"] == answer["choice"]
            worst, compared = max(worst, *map(abs, gaps)), compared + 1
    assert compared >= 15 and worst < 1e-4, (compared, worst)


def test_export_command_writes_the_files_and_says_so(tmp_path, capsys, tiny_qwen_dir):
    out = tmp_path / "dec"
    assert blink.main(["export", str(out), "--model", tiny_qwen_dir]) == 0
    line = capsys.readouterr().out
    assert f"exported {tiny_qwen_dir} to {out}" in line and "255 choice labels" in line and "3 probe prompts" in line
    assert sorted(os.listdir(out)) == ["decision.json", "decision_serve.json", "decision_template.jinja"]
    with pytest.raises(SystemExit):
        blink.main(["export"])


def test_export_refuses_a_model_whose_labels_do_not_verify(tmp_path, tiny_qwen_dir):
    model = tmp_path / "bad"
    shutil.copytree(tiny_qwen_dir, model)
    tok = AutoTokenizer.from_pretrained(model)
    # the generation prompt ends in a letter: "X" + "A" tokenize as the one token "XA", so no label stands alone
    tok.chat_template = tok.chat_template.replace("<think>\\n\\n</think>\\n\\n", "<think>\\n\\n</think>\\n\\nX")
    tok.save_pretrained(model)
    out = tmp_path / "dec"
    with pytest.raises(blink.BlinkError, match="A..Z must all verify"):
        export.export(str(out), str(model), DEFAULTS)
    assert not out.exists()


def test_export_refuses_labels_transformers_reads_as_other_tokens(tiny_qwen_dir):
    engine = blink.PromptEngine(tiny_qwen_dir, None, DEFAULTS)
    export.check_label_ids(engine)  # they agree on the real model
    engine.label_ids = [engine.label_ids[1], engine.label_ids[0], *engine.label_ids[2:]]
    with pytest.raises(blink.BlinkError, match="label 'A' is token .* but token .* on its own"):
        export.check_label_ids(engine)


def test_export_refuses_a_template_that_renders_other_ids(tmp_path, tiny_qwen, exported):
    folder = tmp_path / "edited"
    shutil.copytree(exported(tiny_qwen), folder)
    path = folder / "decision_template.jinja"
    path.write_text(path.read_text(encoding="utf-8").replace('"criterion"', '"Criterion"'), encoding="utf-8")
    with pytest.raises(blink.BlinkError, match="transformers renders other token ids"):
        export.check_export(str(folder), tiny_qwen, export.EXPORT_PROBE)


@pytest.mark.parametrize("extra", [{"permute": 2}, {"multi": True}, {"abstain": {"min_label_mass": 0.5}}])
def test_per_question_features_do_not_travel(extra):
    q = {"type": "choice", "criteria": {"a": "x", "b": "y"}, **extra}
    blink.parse_questions({"q": q})  # blink takes them
    with pytest.raises(ValueError, match="unexpected keyword argument"):
        parse_questions({"q": q}, DecisionConfig())


@pytest.mark.parametrize(
    "q",
    [
        {"type": "choice", "criteria": ["a", "b"]},
        {"type": "noul", "criteria": {"yes": "x"}},
        {"type": "score", "criteria": ["low", None]},
        {"type": "choice", "criteria": {"a": 1, "b": True}},
    ],
)
def test_request_shapes_that_do_not_travel(q):
    blink.parse_questions({"q": q})
    with pytest.raises(ValueError):
        parse_questions({"q": q}, DecisionConfig())
