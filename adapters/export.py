"""blink's prompt as a transformers DecisionConfig: `python blink.py export DIR`.

transformers (>= 5.24) lets a model repository ship its decision prompt: decision.json (labels per question type,
temperature per type, noul option order) and decision_template.jinja, read by pipeline("decision") and
`transformers serve`. That template replaces the whole chat template and receives the request's raw `state` and one
`question` ({type, instructions, options, labels, descriptions}). The exported template applies blink's rendering
rules in Jinja (the mirror of user_message, option_text, text and the noul and score wording), sets blink's two
messages, and then runs the model's own chat template source unchanged, so transformers renders, token for token,
the prompt blink renders. Jinja's tojson is json.dumps(ensure_ascii=False) with default separators, as here.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict

import blink

DECISION_RULES = r"""{#- blink's decision prompt: the system prompt, the user turn as blink renders it (evidence, criterion, lettered
    options), then the model's own chat template with enable_thinking=False. Written by `python blink.py export`. -#}
{%- macro blink_text(x) -%}
{{- "" if x is none else (x if x is string else x|tojson(indent=2)) -}}
{%- endmacro -%}
{#- blink's GENERIC_KEY, ^(?:[A-Za-z]{1,2}|option[_ ]?\d+|opt\d+|\d+)$, where $ also matches before one final newline
    and \d is a Unicode decimal digit (str.isdecimal) -#}
{%- macro blink_generic(k) -%}
{%- set s = k[:-1] if k.endswith("\n") else k -%}
{%- if (s|length in [1, 2] and s.isascii() and s.isalpha())
      or (s.startswith("option") and (s[6:].isdecimal() or (s[6:7] in ["_", " "] and s[7:].isdecimal())))
      or (s.startswith("opt") and s[3:].isdecimal())
      or s.isdecimal() -%}
{{- "1" -}}
{%- endif -%}
{%- endmacro -%}
{%- macro blink_option(k, desc) -%}
{%- if desc is none or (desc is string and not desc.strip()) -%}
{{- k -}}
{%- else -%}
{%- set d = blink_text(desc) -%}
{{- d if (blink_generic(k) or k.strip().lower() == d.strip().lower()) else k ~ ": " ~ d -}}
{%- endif -%}
{%- endmacro -%}
{%- set blink_ns = namespace(options=[]) -%}
{%- for blink_key in question.options -%}
{%- set blink_desc = question.descriptions[loop.index0] -%}
{%- if question.type == "choice" -%}
{%- set blink_shown = blink_option(blink_key, blink_desc) -%}
{%- elif question.type == "noul" -%}
{%- set blink_shown = ("Yes" if blink_key == "true" else "No") ~ ((" \u2014 " ~ blink_text(blink_desc)) if blink_desc else "") -%}
{%- else -%}
{%- set blink_shown = ("Level " ~ loop.index0 ~ ": " ~ blink_text(blink_desc)) if blink_desc is not none else ("Level " ~ loop.index0) -%}
{%- endif -%}
{%- set blink_ns.options = blink_ns.options + [{"letter": question.labels[loop.index0], "description": blink_shown}] -%}
{%- endfor -%}
{%- set blink_user = {"evidence": state, "criterion": blink_text(question.instructions).strip(), "options": blink_ns.options}|tojson -%}
"""  # noqa: E501 (read whole: a tool description and a template)
EXPORT_PROBE = {  # the export renders this through transformers and refuses to write a config that differs from blink
    "state": {"ticket": "Zweimal belastet — refund? 🙂", "lines": [1, 2.5, None, True], "note": "AB\n"},
    "questions": {
        "tone": {
            "type": "choice",
            "instructions": "  What is the tone?\n",
            "criteria": {
                "calm": "A polite message",
                "A": "a generic key",
                "opt3": {"nested": ["ü", 1]},
                "Option 5": "not generic",
                "same": "Same ",
                "blank": "  ",
                "none": None,
                "12": "digits",
                "lst": ["a", {"b": 2}],
            },
        },
        "spam": {"type": "noul", "instructions": {"ask": "Is this spam?"}, "criteria": {"true": "Unsolicited ads"}},
        "urgency": {"type": "score", "criteria": ["Can wait", "", {"when": "today"}]},
    },
}


def decision_template(chat_template: str) -> str:
    """The Jinja source transformers renders blink's prompt with: blink's rules, its two messages, then the model's
    own chat template. The last tag keeps its newline so trim_blocks eats exactly that one and the model's template
    starts a line of its own, as when it stands alone (its leading whitespace and lstrip_blocks act the same)."""  # noqa: E501 (read whole: a tool description and a template)
    messages = (
        f'{{%- set messages = [{{"role": "system", "content": {json.dumps(blink.SYSTEM, ensure_ascii=False)}}}, '
        '{"role": "user", "content": blink_user}] -%}\n'
        "{%- set add_generation_prompt = true -%}\n{%- set enable_thinking = false %}\n"
    )
    return DECISION_RULES + messages + chat_template


def exported_labels(engine: blink.PromptEngine) -> dict[str, list[str]]:
    """decision.json's labels per question type as blink offers them: every verified label for a choice, the first
    ten for a score's levels, A and B for a noul (yes first: noul_options puts true first)."""
    return {"choice": list(engine.labels), "score": list(engine.labels[:10]), "noul": list(engine.labels[:2])}


def check_label_ids(engine: blink.PromptEngine) -> None:
    """Refuse a model whose labels transformers would read as other tokens: it tokenizes each label on its own,
    blink verified them right after the assistant header."""
    from transformers.decision.template_utils import label_token_ids

    for label, expected in zip(engine.labels, engine.label_ids):
        try:
            (got,) = label_token_ids(engine.tok, (label,))
        except ValueError:
            got = None
        if got != expected:
            raise blink.BlinkError(
                f"label {label!r} is token {expected} after the assistant header but "
                f"{'not one token' if got is None else f'token {got}'} on its own: transformers "
                "would read another token, so this model cannot be exported"
            )


def check_export(folder: str, engine: blink.PromptEngine, request: dict) -> int:
    """Render `request` through transformers' prepare_inputs with the config in `folder` (on a copy of the tokenizer:
    prepare_inputs adds its sentinel tokens to the one it is given) and refuse any prompt whose ids differ from
    blink's. Returns the number of prompts compared."""
    from transformers.decision import DecisionConfig

    config = DecisionConfig.from_pretrained(folder)
    theirs = config.prepare_inputs(request, copy.deepcopy(engine.tok))
    ours = engine.render(blink.parse_request(request["state"], request["questions"], settings=engine.settings))
    if len(theirs) != len(ours):
        raise blink.BlinkError(f"transformers renders {len(theirs)} prompts for {len(ours)} questions")
    for (inputs, (question,)), prompt in zip(theirs, ours):
        if question.name != prompt.qkey or inputs["input_ids"][0].tolist() != prompt.ids:
            raise blink.BlinkError(
                f"question {prompt.qkey!r}: transformers renders other token ids than blink with "
                "this model's chat template; nothing was written"
            )
    return len(ours)


def export(out_dir: str, model: str | None = None, settings: blink.Settings | None = None) -> dict:
    """Write decision.json and decision_template.jinja for a served model, plus decision_serve.json (the same with
    the template inside, which `transformers serve --decision-config` needs), after checking its labels and rendering
    a probe request both ways. Loads the tokenizer only. Returns what was written."""
    from transformers.decision import DecisionConfig

    settings = settings or blink.env_settings()
    model_id = model or settings.default_model
    engine = blink.PromptEngine(model_id, settings.revision(model_id), settings)  # refuses labels that do not verify
    check_label_ids(engine)
    config = DecisionConfig(
        labels=exported_labels(engine),
        temperature=dict.fromkeys(blink.QUESTION_TYPES, settings.temperature),
        chat_template=decision_template(engine.tok.get_chat_template()),
        noul_options=["true", "false"],
        sanitize_control_tokens=False,
    )
    with tempfile.TemporaryDirectory() as staging:  # nothing reaches out_dir until the probe renders the same
        config.save_pretrained(staging)
        checked = check_export(staging, engine, EXPORT_PROBE)
        with open(os.path.join(staging, "decision_serve.json"), "w", encoding="utf-8") as fh:
            json.dump(asdict(config), fh, ensure_ascii=False, indent=2)
            fh.write("\n")
        os.makedirs(out_dir, exist_ok=True)
        files = sorted(os.listdir(staging))
        for name in files:
            shutil.copyfile(os.path.join(staging, name), os.path.join(out_dir, name))
    return {
        "model": model_id,
        "revision": engine.revision,
        "folder": out_dir,
        "files": files,
        "choice_labels": len(engine.labels),
        "temperature": settings.temperature,
        "probe_prompts": checked,
    }


def main(argv: list[str] | None = None) -> int:
    """`python blink.py export DIR [--model ID]`: 0 when written, 2 when refused (nothing written then)."""
    parser = argparse.ArgumentParser(
        prog="blink.py export", description="write blink's prompt as a transformers DecisionConfig"
    )
    parser.add_argument("data", metavar="DIR", help="the folder to write decision.json and decision_template.jinja to")
    parser.add_argument("--model", default=None, help="one of the served models (BLINK_MODELS)")
    args = parser.parse_args(argv)
    try:
        done = export(args.data, args.model)
    except blink.BlinkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"exported {done['model']} to {done['folder']}: {', '.join(done['files'])} ({done['choice_labels']} "
        f"choice labels, temperature {done['temperature']:g}; {done['probe_prompts']} probe prompts render the same "
        "token ids in transformers)"
    )
    return 0
