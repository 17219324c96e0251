"""blink Space: a Gradio Blocks page and an API over blink.py.

The page: evidence, a question editor, temperature and (when several models are served) a model picker; results as
bars over every option. Bundled presets (examples/) render at once from the recording (replay.json); anything edited
runs the live model. Programs call the named endpoints /decide, /decide_batch and /info with gradio_client (also
served as MCP tools). The HTTP layer (adapters/http.py) serves System One (/v1/systemone, /v1/models), OpenAI
Decisions (/v1/decisions) and /metrics on the same port, with one body limit and one key for every route; the Space
glue (adapters/space.py) makes `demo` that whole app however it is started.

Sections: settings · inputs · rendering · the page · the API · launch.
"""

from __future__ import annotations

try:  # ZeroGPU: `spaces` must be imported before anything initialises CUDA
    import spaces
except ImportError:  # off a Space, on a machine without the package
    spaces = None

import functools
import html
import json
import logging
import os
from collections.abc import Collection

import gradio as gr

import blink
from adapters import http, space

log = logging.getLogger("blink.app")

# ==================================================================================================================
# Settings: the deployment this process serves (the engine's BLINK_* variables are read in blink.Settings, the
# server's in adapters/http.py ServerSettings)
# ==================================================================================================================

try:
    DEPLOYMENT = blink.deployment()
    SERVER = http.ServerSettings.from_env()
except blink.BlinkError as exc:  # a bad variable stops the server with one line naming it
    raise SystemExit(f"blink: {exc}") from None
SETTINGS = DEPLOYMENT.settings
HTTP = http.HttpLayer(DEPLOYMENT, SERVER, space.ZeroGpu())  # the /v1 routes, /metrics, the body limit and the key
PRESETS: dict[str, dict] = {ex["name"]: ex for ex in map(blink.load_example, blink.example_files())}

# ==================================================================================================================
# Inputs: what a person or a program sends, parsed into a blink.Request, with the field named on every mistake
# ==================================================================================================================


def parse_request(state, questions, temperature, images, prefer: str = "live") -> blink.Request:
    """One request as the page or the API sends it, checked and parsed once (blink.parse_request reads state and
    questions given as JSON text the same for every entry); temperature None: the calibrated or default one."""
    return DEPLOYMENT.request(state, questions, images=images, temperature=temperature, prefer=prefer)


def error_text(exc: Exception) -> str:
    """The message a caller sees for a refused request, naming the field when there is one."""
    field = blink.field_name(exc.loc) if isinstance(exc, (blink.BlinkError, blink.BlinkBusy)) else ""
    return f"{exc} (field: {field})" if field else str(exc)


def image_uris(path: str | None) -> list[str]:
    """The uploaded image as a data URI for blink's vision path (an empty list when none was given)."""
    return [blink.image_data_uri(path)] if path else []


# ==================================================================================================================
# Rendering: results as people read them
# ==================================================================================================================


def esc(value) -> str:
    """Text made safe for HTML."""
    return html.escape(str(value), quote=True)


def pct(p: float) -> str:
    """A probability as a percentage with sensible precision."""
    if p >= 0.995:
        return f"{p * 100:.1f}%"
    return f"{p * 100:.1f}%" if p >= 0.001 else f"{p * 100:.2g}%"


def bars(
    rows: list[tuple[str, str, float]], chosen: Collection[str | None], scale: float | None = None, ticks: bool = False
) -> str:
    """One bar per option, in request order: every option is shown, however many there are. Widths are relative to
    the largest bar, or to `scale` when given; `ticks` adds a checkbox per row, ticked for the chosen keys."""
    top = scale or max((p for _, _, p in rows), default=1.0) or 1.0
    out = []
    for key, label, p in rows:
        on = key in chosen
        cls = "bk-row bk-chosen" if on else "bk-row"
        tick = (
            f'<span class="bk-tick" role="checkbox" aria-checked="{str(on).lower()}">{"✓" if on else ""}</span>'
            if ticks
            else ""
        )
        out.append(
            f'<div class="{cls}" data-option="{esc(key)}" title="{esc(label)}: {pct(p)}">'
            f'<span class="bk-label">{tick}{esc(label)}</span>'
            f'<span class="bk-track"><span class="bk-fill" style="width:{100 * p / top:.2f}%"></span></span>'
            f'<span class="bk-pct">{pct(p)}</span></div>'
        )
    return f'<div class="bk-bars{" bk-checklist" if ticks else ""}">{"".join(out)}</div>'


def option_labels(q: blink.Question) -> list[tuple[str, str]]:
    """(option key, what the bar is labelled) in request order."""
    if q.type == "score":
        return [(o.key, f"{o.key} · {blink.text(q.spec['criteria'][int(o.key)])}") for o in q.options]
    if q.type == "noul":
        return [("yes", "yes"), ("no", "no")]
    return [
        (k, k if k == d else f"{k} — {d[len(k) + 2 :]}" if d.startswith(f"{k}: ") else d)
        for k, d in ((o.key, o.text) for o in q.options)
    ]


def option_rows(q: blink.Question, ans: dict) -> list[tuple[str, str, float]]:
    """(option key, bar label, probability) for every option, in request order."""
    return [(k, lab, ans["probabilities"][k]) for k, lab in option_labels(q)]


def pick_html(value: str | None) -> str:
    """The answer's pick, highlighted; an abstained answer has none."""
    return '<b class="bk-answer bk-nopick">no pick</b>' if value is None else f'<b class="bk-answer">{esc(value)}</b>'


def mass_badge(ans: dict) -> str:
    """The on-label badge: how much of the model's own next-token distribution fell on the offered labels."""
    mass = ans.get("label_mass")
    what = "share of the model's next-token distribution (T = 1) on the offered labels"
    if mass is None:
        return f'<span class="bk-badge bk-mass bk-mass-na" title="{what}: not recorded">on-label n/a</span>'
    cls = "bk-badge bk-mass bk-mass-low" if mass < 0.5 else "bk-badge bk-mass"
    return f'<span class="{cls}" title="{what}: {mass:.4f}">on-label {pct(mass)}</span>'


def abstain_chip(ans: dict) -> str:
    """The Abstained chip (nothing when the answer did not abstain)."""
    if not ans.get("abstained"):
        return ""
    return f'<span class="bk-badge bk-abstain" title="{esc(ans.get("reason", ""))}">Abstained</span>'


def card_head(q: blink.Question, ans: dict, summary: str) -> str:
    """The title row of one question's card: name, type, the on-label badge, any abstention (and why), summary."""
    instructions = blink.text(q.spec.get("instructions")).strip()
    reason = f'<div class="bk-reason">{esc(ans.get("reason", ""))}</div>' if ans.get("abstained") else ""
    return (
        f'<div class="bk-head"><span class="bk-key">{esc(q.key)}</span>'
        f'<span class="bk-type bk-{q.type}">{"multi" if ans.get("multi") else q.type}</span>'
        f'{mass_badge(ans)}{abstain_chip(ans)}<span class="bk-summary">{summary}</span></div>'
        + reason
        + (f'<div class="bk-instr">{esc(instructions)}</div>' if instructions else "")
    )


def rotation_line(ans: dict) -> str:
    """For a permuted choice: order sensitivity, the rotation count and each rotation's own pick."""
    if "rotations" not in ans:
        return ""
    agree = len(set(ans["rotation_choices"])) == 1
    picks = "".join(f'<span class="bk-rot">{esc(c)}</span>' for c in ans["rotation_choices"])
    return (
        f'<div class="bk-rotations{"" if agree else " bk-rot-split"}" data-rotations="{ans["rotations"]}">'
        f"order sensitivity <b>{ans['order_sensitivity']:.2f}</b> · {ans['rotations']} rotation(s): {picks}"
        f"{'' if agree else ' · the rotations disagree'}</div>"
    )


def choice_card(q: blink.Question, ans: dict) -> str:
    """A choice: the chosen option, its confidence, and bars over every option (a checklist for multi)."""
    if ans.get("multi"):
        return multi_card(q, ans)
    summary = f"{pick_html(ans['choice'])} · confidence {ans['confidence']:.2f}"
    return card_head(q, ans, summary) + rotation_line(ans) + bars(option_rows(q, ans), [ans["choice"]])


def multi_card(q: blink.Question, ans: dict) -> str:
    """A multi-label choice: a checklist with an absolute p(yes) bar per option, ticked for those above 0.5."""
    chosen = ans["choices"]
    count = (
        pick_html(None)
        if chosen is None
        else f'<b class="bk-answer">{len(chosen)}</b> of {len(ans["probabilities"])} apply'
    )
    summary = f"{count} · confidence {ans['confidence']:.2f}"
    return card_head(q, ans, summary) + bars(option_rows(q, ans), chosen or [], scale=1.0, ticks=True)


def noul_card(q: blink.Question, ans: dict) -> str:
    """A yes/no question: p(yes) as a meter."""
    p = ans["probabilities"]["yes"]  # the same as ans["noul"], which an abstained answer leaves null
    lean = pick_html(None) if ans["noul"] is None else f"leans {'yes' if p >= 0.5 else 'no'}"
    summary = f'p(yes) = <b class="bk-answer">{p:.3f}</b> · {lean}'
    meter = (
        f'<div class="bk-meter" role="meter" aria-valuemin="0" aria-valuemax="1" aria-valuenow="{p:.4f}">'
        f'<span class="bk-meter-fill" style="width:{100 * p:.2f}%"></span>'
        f'<span class="bk-meter-mid"></span></div>'
        f'<div class="bk-meter-scale"><span>no</span><span>0.5</span><span>yes</span></div>'
    )
    return card_head(q, ans, summary) + meter


def score_card(q: blink.Question, ans: dict) -> str:
    """A score: the expected value on the level scale, the distribution over levels, the legend in the bars."""
    top = len(q.options) - 1
    if ans["score"] is None:
        summary, scale = f"{pick_html(None)} on 0–{top} · confidence {ans['confidence']:.2f}", ""
    else:
        summary = (
            f'expected <b class="bk-answer">{ans["score"]:.2f}</b> of 0–{top} · most likely level '
            f"{esc(ans['choice'])} ({ans['confidence']:.2f} confidence)"
        )
        scale = (
            f'<div class="bk-scale"><span class="bk-scale-marker" style="left:{100 * ans["score"] / top:.2f}%"'
            f' title="expected score {ans["score"]:.2f}"></span></div>'
        )
    return card_head(q, ans, summary) + scale + bars(option_rows(q, ans), [ans["choice"]])


_CARDS = {"choice": choice_card, "noul": noul_card, "score": score_card}


def render_answers(request: blink.Request, result: dict) -> str:
    """Every question's card, in request order (an abstained answer's card is greyed)."""
    cards = []
    for q in request.questions:
        ans = result["answers"][q.key]
        cls = "bk-card bk-abstained" if ans.get("abstained") else "bk-card"
        cards.append(f'<div class="{cls}" data-question="{esc(q.key)}">{_CARDS[q.type](q, ans)}</div>')
    return f'<div class="bk-results">{"".join(cards)}</div>'


def source_name(source: str) -> str:
    """Where a temperature came from, in a word or two: request, default, or the calibration file's name."""
    kind, _, path = source.partition(":")
    return f"calibration {os.path.basename(path)}" if kind == "calibration" and path else source


def listed(names: list[str], at_most: int = 3) -> str:
    """A few names, the rest counted: 'a, b, c +2'."""
    more = f" +{len(names) - at_most}" if len(names) > at_most else ""
    return ", ".join(names[:at_most]) + more


def temperature_text(meta: dict) -> str:
    """The applied temperature and its source; per-question values grouped compactly when questions differ."""
    temps, sources = meta["temperature"], meta.get("temperature_source", "")
    keys = list(temps) if isinstance(temps, dict) else list(sources) if isinstance(sources, dict) else []
    if not keys:
        return f"T = {temps:g}" + (f" ({esc(source_name(sources))})" if sources else "")
    groups: dict[tuple[float, str], list[str]] = {}
    for k in keys:
        t = temps[k] if isinstance(temps, dict) else temps
        s = sources.get(k, "") if isinstance(sources, dict) else sources
        groups.setdefault((t, s), []).append(k)
    full = "; ".join(f"{t:g} ({s}) for {', '.join(names)}" for (t, s), names in groups.items())
    short = "; ".join(f"{t:g} ({source_name(s)}) for {listed(names)}" for (t, s), names in groups.items())
    return f'<span class="bk-temps" title="{esc(full)}">T = {esc(short)}</span>'


def render_meta(meta: dict) -> str:
    """Where the numbers came from: engine, model, tokens, latency; the recording; a fabricated-numbers notice."""
    parts = [
        f"<b>{esc(meta['engine'])}</b>",
        esc(meta["model"]),
        f"{meta['input_tokens']:,} input tokens",
        "0 generated",
    ]
    if meta["engine"] == "replay":
        rec = DEPLOYMENT.recording(meta["model"])
        when = f" {esc(rec.recorded_at[:10])}" if rec is not None and rec.recorded_at else ""
        parts.append(f"{meta['latency_ms']:,.0f} ms when recorded")
        line = (
            f'<div class="bk-source bk-replay">Recorded{when} on {esc(meta.get("recorded_on", "unknown hardware"))}'
            f" — served from the recording, no model call.</div>"
        )
    elif meta.get("answer_cache"):  # an exact repeat: the live model's first answer, kept
        parts.append(f"{meta['latency_ms']:,.0f} ms")
        line = '<div class="bk-source bk-live">Repeat: answered from the answer cache, no model call.</div>'
    elif "model_ms" in meta:  # a live model ran (the torch or the vllm backend)
        parts.append(f"{meta['latency_ms']:,.0f} ms ({meta['model_ms']:,.0f} ms model)")
        if meta.get("cached_tokens"):
            parts.append(f"{meta['cached_tokens']:,} tokens read from a shared prefix, not computed again")
        if meta.get("batched_requests", 1) > 1:
            parts.append(f"batched with {meta['batched_requests'] - 1} other request(s)")
        line = '<div class="bk-source bk-live">Live: the model ran on this input.</div>'
    else:
        parts.append(f"{meta['latency_ms']:,.0f} ms")
        line = ""
    notice = ""
    if meta.get("fabricated"):
        notice = f'<div class="bk-notice bk-fabricated" role="alert">⚠ {esc(meta["notice"])}</div>'
    parts.append(temperature_text(meta))
    return f'{notice}{line}<div class="bk-meta">{" · ".join(parts)}</div>'


def render_error(exc: Exception) -> str:
    """A refused request shown in the page (a recording miss reads as advice, anything else as a mistake)."""
    if isinstance(exc, blink.ReplayMiss):
        return f'<div class="bk-notice bk-miss" role="status">{esc(exc)}</div>'
    return f'<div class="bk-notice bk-error" role="alert"><b>Cannot run this request.</b> {esc(error_text(exc))}</div>'


def deployment_line() -> str:
    """What this deployment serves, shown under the title."""
    mid = DEPLOYMENT.default_model
    kind = DEPLOYMENT.engine_kind(mid)
    rec = DEPLOYMENT.recording(mid)
    if rec is not None:
        saved = f"presets served from a recording made on {esc(rec.hardware)} ({esc(rec.recorded_at[:10])})"
    else:
        saved = "no recording for this model: presets run live"
    extra = f" · {len(DEPLOYMENT.models())} models served" if len(DEPLOYMENT.models()) > 1 else ""
    fabricated = ' · <b class="bk-warn">mock engine: numbers are fabricated</b>' if kind == "mock" else ""
    return (
        f'<div class="bk-deploy">Model <code>{esc(mid)}</code> · engine <code>{esc(kind)}</code> · '
        f"{saved}{extra}{fabricated}</div>"
    )


CSS = """
.bk-deploy { font-size: 0.9em; opacity: 0.85; }
.bk-results { display: flex; flex-direction: column; gap: 12px; }
.bk-card { border: 1px solid var(--border-color-primary); border-radius: 10px; padding: 12px 14px;
           background: var(--block-background-fill); }
.bk-head { display: flex; align-items: baseline; gap: 8px; flex-wrap: wrap; }
.bk-key { font-weight: 700; font-family: var(--font-mono); }
.bk-type { font-size: 0.75em; padding: 1px 8px; border-radius: 999px; color: #fff; }
.bk-choice { background: #4f46e5; } .bk-noul { background: #0d9488; } .bk-score { background: #d97706; }
.bk-summary { margin-left: auto; }
.bk-answer { color: var(--color-accent); }
.bk-instr { font-size: 0.88em; opacity: 0.8; margin: 4px 0 8px; }
.bk-bars { display: flex; flex-direction: column; gap: 3px; }
.bk-row { display: grid; grid-template-columns: minmax(90px, 38%) 1fr 58px; align-items: center; gap: 8px;
          font-size: 0.86em; }
.bk-label { overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.bk-track { height: 14px; border-radius: 4px; background: var(--background-fill-secondary); overflow: hidden; }
.bk-fill { display: block; height: 100%; border-radius: 4px; background: #a5b4fc; min-width: 1px; }
.bk-chosen .bk-fill { background: var(--color-accent); }
.bk-chosen .bk-label { font-weight: 700; }
.bk-pct { text-align: right; font-variant-numeric: tabular-nums; }
.bk-meter { position: relative; height: 22px; border-radius: 11px; overflow: hidden; margin-top: 8px;
            background: linear-gradient(90deg, #fecaca, #fef3c7 50%, #bbf7d0); }
.bk-meter-fill { position: absolute; inset: 0 auto 0 0; background: rgba(13, 148, 136, 0.55); }
.bk-meter-mid { position: absolute; left: 50%; top: 0; bottom: 0; width: 2px; background: rgba(0, 0, 0, 0.35); }
.bk-meter-scale { display: flex; justify-content: space-between; font-size: 0.75em; opacity: 0.7; }
.bk-scale { position: relative; height: 8px; margin: 10px 4px 10px; border-radius: 4px;
            background: linear-gradient(90deg, #e0e7ff, #fde68a, #fca5a5); }
.bk-scale-marker { position: absolute; top: -5px; width: 4px; height: 18px; margin-left: -2px; border-radius: 2px;
                   background: var(--body-text-color); }
.bk-badge { font-size: 0.75em; padding: 1px 8px; border-radius: 999px; border: 1px solid #86efac;
            background: #dcfce7; color: #14532d; white-space: nowrap; }
.bk-mass-low { background: #fef3c7; color: #78350f; border-color: #f59e0b; }
.bk-mass-na { background: var(--background-fill-secondary); color: inherit; border-color: var(--border-color-primary);
              opacity: 0.75; }
.bk-abstain { background: #e5e7eb; color: #374151; border-color: #9ca3af; font-weight: 700; }
.bk-reason { font-size: 0.85em; color: #6b7280; margin-top: 4px; }
.bk-answer.bk-nopick { color: #6b7280; }
.bk-abstained .bk-bars, .bk-abstained .bk-meter, .bk-abstained .bk-meter-scale { filter: grayscale(1); opacity: 0.45; }
.bk-rotations { font-size: 0.85em; margin: 2px 0 8px; }
.bk-rot { font-family: var(--font-mono); padding: 0 6px; margin-left: 3px; border-radius: 4px;
          background: var(--background-fill-secondary); }
.bk-rot-split { color: #b45309; }
.bk-tick { display: inline-flex; align-items: center; justify-content: center; width: 13px; height: 13px;
           margin-right: 6px; vertical-align: -2px; border: 1.5px solid #9ca3af; border-radius: 3px; font-size: 0.8em; }
.bk-chosen .bk-tick { background: var(--color-accent); border-color: var(--color-accent); color: #fff; }
.bk-checklist .bk-track { position: relative; }
.bk-checklist .bk-track::after { content: ""; position: absolute; left: 50%; top: 0; bottom: 0; width: 1px;
                                 background: rgba(0, 0, 0, 0.35); }
.bk-notice { border-radius: 8px; padding: 10px 12px; margin-bottom: 8px; }
.bk-error { background: #fee2e2; color: #7f1d1d; border: 1px solid #fca5a5; }
.bk-miss { background: #e0f2fe; color: #0c4a6e; border: 1px solid #7dd3fc; }
.bk-fabricated { background: #fef3c7; color: #78350f; border: 2px solid #f59e0b; font-weight: 700; }
.bk-warn { color: #b45309; }
.bk-source { font-size: 0.9em; margin-bottom: 2px; }
.bk-meta { font-size: 0.85em; opacity: 0.8; }
.bk-hint { font-size: 0.85em; opacity: 0.75; }
"""

# ==================================================================================================================
# The page
# ==================================================================================================================

QUESTION_FORM_HELP = (
    "One option per line. **choice**: an option per line, or `key: description`. **score**: the levels, lowest "
    "first (2 to 10). **noul**: optional `yes: …` and `no: …` lines describing each side. Rotations, multi and the "
    "abstain thresholds are optional: 0 and unticked leave a plain question."
)


def state_text(state) -> str:
    """Evidence as the editor shows it: text as it is, JSON indented (parsed back to the same value)."""
    return blink.text(state)


def questions_text(questions: dict) -> str:
    """Questions as the editor shows them, in request order."""
    return json.dumps(questions, ensure_ascii=False, indent=2)


def ui_result(state, questions, temperature, model, image=None) -> tuple[str, str, str]:
    """(meta html, answers html, answer JSON) for the page; a refused request shows its message in place.
    `temperature` None lets the calibrated (or default) temperature apply; the meta line says which did."""
    try:
        request = parse_request(state, questions, temperature, image_uris(image), "saved")
        result = DEPLOYMENT.submit(request, model)
    except (blink.BlinkError, blink.BlinkBusy) as exc:
        body = {"error": str(exc), "loc": exc.loc}
        return render_error(exc), "", json.dumps(body, ensure_ascii=False, indent=2)
    except Exception as exc:  # noqa: BLE001 - shown as a message, never as a traceback
        log.exception("request failed")
        return render_error(RuntimeError(f"the model failed on this request ({type(exc).__name__})")), "", "{}"
    hint = ""
    if isinstance(request.state, str) and request.state.strip().startswith(("{", "[")):
        hint = '<div class="bk-hint">The evidence looks like JSON but does not parse, so it was read as text.</div>'
    return (
        hint + render_meta(result["meta"]),
        render_answers(request, result),
        json.dumps(result, ensure_ascii=False, indent=2),
    )


def chosen_temperature(temperature, moved: bool) -> float | None:
    """The slider's temperature once the person has moved it; before that None (calibration or the default)."""
    return temperature if moved else None


def ui_decide(state, questions, temperature, moved, model, image, progress=gr.Progress()):  # noqa: B008 - Gradio idiom
    """The Decide button: recorded presets come back at once, anything edited runs the live model."""
    progress(0, desc="Running the model…")
    return ui_result(state, questions, chosen_temperature(temperature, moved), model, image)


def ui_preset(name: str, temperature, moved, model):
    """Load a preset into the editors and show its answers (from the recording when there is one)."""
    ex = PRESETS.get(name)
    if ex is None:
        return (gr.update(), gr.update(), "", render_error(blink.BlinkError(f"no preset named {name!r}")), "", "{}")
    st, qs = state_text(ex["state"]), questions_text(ex["questions"])
    meta, answers, raw = ui_result(st, qs, chosen_temperature(temperature, moved), model)
    return st, qs, f"*{ex.get('description', '')}*", meta, answers, raw


def question_extras(permute, multi, min_label_mass, min_confidence) -> dict:
    """The form's opt-in fields of a question, only those that were set: an empty number or 0 is off (the page
    sends an empty number as 0, and a threshold of 0 never abstains). blink.parse_question judges the rest."""
    extras: dict = {}
    if permute:
        extras["permute"] = int(permute) if isinstance(permute, float) and permute.is_integer() else permute
    if multi:
        extras["multi"] = True
    thresholds = {"min_label_mass": min_label_mass, "min_confidence": min_confidence}
    if any(thresholds.values()):
        extras["abstain"] = {k: v for k, v in thresholds.items() if v}
    return extras


def build_question(
    questions,
    name: str,
    qtype: str,
    instructions: str,
    options: str,
    permute=None,
    multi: bool = False,
    min_label_mass=None,
    min_confidence=None,
) -> str:
    """The questions JSON with one question added from the form (permute, multi and abstain only when set)."""
    name = (name or "").strip()
    try:
        current = {} if (questions or "").strip() in ("", "{}") else blink.coerce_questions(questions)
        if current:
            blink.parse_questions(current)
    except blink.BlinkError as exc:
        raise gr.Error(esc(f"fix the questions JSON first: {exc}"), print_exception=False) from None
    if not name:
        raise gr.Error("give the new question a name", print_exception=False)
    if name in current:
        raise gr.Error(esc(f"a question named {name!r} already exists"), print_exception=False)
    lines = [line.strip() for line in (options or "").splitlines() if line.strip()]
    q: dict = {"type": qtype, "instructions": (instructions or "").strip()}
    if qtype == "choice":
        if len(lines) < 2:
            raise gr.Error("a choice needs at least two options, one per line", print_exception=False)
        pairs = [line.split(":", 1) for line in lines]
        q["criteria"] = {k.strip(): v.strip() for k, v in pairs} if all(len(p) == 2 for p in pairs) else lines
    elif qtype == "score":
        q["criteria"] = lines
    else:
        sides = dict(line.split(":", 1) for line in lines if ":" in line)
        described = {"true": sides.get("yes", "").strip(), "false": sides.get("no", "").strip()}
        if any(described.values()):
            q["criteria"] = {k: v for k, v in described.items() if v}
    q.update(question_extras(permute, multi, min_label_mass, min_confidence))
    try:
        blink.parse_question(name, q)
    except blink.BlinkError as exc:
        raise gr.Error(esc(str(exc)), print_exception=False) from None
    current[name] = q
    return questions_text(current)


def choice_only_controls(qtype: str) -> tuple:
    """permute and multi apply to choice questions only: shown (and kept) for a choice, hidden and cleared else."""
    if qtype == "choice":
        return gr.update(visible=True), gr.update(visible=True)
    return gr.update(visible=False, value=0), gr.update(visible=False, value=False)


def opening_view(name: str | None) -> tuple[str, str, str, str, str, str]:
    """What the page opens on: the first preset in the editors, answered when that costs no model call."""
    if name is None:
        return "", "{}", "", "", "", "{}"
    ex = PRESETS[name]
    st, qs = state_text(ex["state"]), questions_text(ex["questions"])
    note = f"*{ex.get('description', '')}*"
    if not DEPLOYMENT.instant(DEPLOYMENT.request(ex["state"], ex["questions"], prefer="saved")):
        return st, qs, note, '<div class="bk-hint">Press <b>Decide</b> to run the live model.</div>', "", "{}"
    return (st, qs, note, *ui_result(st, qs, None, None))


def build_page() -> None:
    """The UI, inside the current Blocks."""
    first = next(iter(PRESETS), None)
    st0, qs0, note0, meta0, answers0, raw0 = opening_view(first)
    gr.Markdown(
        "# blink — typed decisions in one forward pass\n"
        "Ask a model typed questions about some evidence — pick one of many options (`choice`), the "
        "probability of yes (`noul`), or a level on a scale (`score`). Every answer is read from the "
        "next-token distribution over the option labels: no text is generated."
    )
    gr.HTML(deployment_line())
    with gr.Row(equal_height=False):
        with gr.Column(scale=5):
            preset = gr.Dropdown(list(PRESETS), value=first, label="Preset", elem_id="preset")
            preset_note = gr.Markdown(note0)
            with gr.Row():
                evidence = gr.Textbox(
                    st0, label="Evidence (text or JSON)", lines=10, max_lines=24, elem_id="evidence", scale=3
                )
                image = gr.Image(
                    label="Image (read by vision models)",
                    type="filepath",
                    format="png",
                    sources=["upload", "clipboard"],
                    elem_id="image",
                    scale=2,
                )
            questions = gr.Code(
                qs0,
                label="Questions (JSON)",
                language="json",
                lines=10,
                max_lines=22,
                wrap_lines=True,
                elem_id="questions",
            )
            with gr.Accordion("Add a question", open=False):
                with gr.Row():
                    q_name = gr.Textbox(label="Name", placeholder="e.g. urgent", scale=2)
                    q_type = gr.Radio(["choice", "noul", "score"], value="choice", label="Type", scale=3)
                q_instr = gr.Textbox(label="Instructions", placeholder="What should the model decide?")
                q_opts = gr.Textbox(label="Options", lines=4, placeholder="billing\naccess\nbug")
                with gr.Row():
                    q_permute = gr.Number(
                        0,
                        label="Rotations (permute)",
                        precision=0,
                        minimum=0,
                        info="choice: average over this many option orders (0 = off)",
                        elem_id="q-permute",
                    )
                    q_multi = gr.Checkbox(
                        False, label="Which of these apply (multi)", info="choice: p(yes) per option", elem_id="q-multi"
                    )
                with gr.Row():
                    q_min_mass = gr.Number(
                        0,
                        label="Abstain below label mass",
                        minimum=0,
                        maximum=1,
                        step=0.05,
                        info="0 to 1 (0 = off)",
                        elem_id="q-min-mass",
                    )
                    q_min_conf = gr.Number(
                        0,
                        label="Abstain below confidence",
                        minimum=0,
                        maximum=1,
                        step=0.05,
                        info="0 to 1 (0 = off)",
                        elem_id="q-min-conf",
                    )
                gr.Markdown(QUESTION_FORM_HELP, elem_classes="bk-hint")
                add = gr.Button("Add to questions", size="sm", elem_id="q-add")
            with gr.Row():
                temperature = gr.Slider(
                    0.05,
                    5.0,
                    value=SETTINGS.temperature,
                    step=0.05,
                    label="Temperature",
                    info="untouched: the calibrated or default temperature applies (the "
                    "answer line says which); moved: yours",
                    elem_id="temperature",
                )
                moved = gr.State(False)  # whether the person has moved the slider
                model = gr.Dropdown(
                    DEPLOYMENT.models(),
                    value=DEPLOYMENT.default_model,
                    label="Model",
                    visible=len(DEPLOYMENT.models()) > 1,
                    elem_id="model",
                )
            run_btn = gr.Button("Decide", variant="primary", elem_id="decide")
            gr.Markdown(
                "An unedited preset is answered from its recording at once; any edit runs the live model.",
                elem_classes="bk-hint",
            )
        with gr.Column(scale=6):
            meta = gr.HTML(meta0, elem_id="meta")
            answers = gr.HTML(answers0, elem_id="answers")
            with gr.Accordion("Answer JSON", open=False):
                raw = gr.Code(raw0, language="json", interactive=False, max_lines=40, elem_id="raw")
    outputs = [meta, answers, raw]
    temperature.input(lambda: True, None, moved, api_visibility="private", queue=False, show_progress="hidden")
    preset.change(
        ui_preset,
        [preset, temperature, moved, model],
        [evidence, questions, preset_note, *outputs],
        api_visibility="private",
        show_progress="minimal",
    )
    run_btn.click(ui_decide, [evidence, questions, temperature, moved, model, image], outputs, api_visibility="private")
    q_type.change(
        choice_only_controls,
        q_type,
        [q_permute, q_multi],
        api_visibility="private",
        concurrency_limit=None,
        show_progress="hidden",
    )
    add.click(
        build_question,
        [questions, q_name, q_type, q_instr, q_opts, q_permute, q_multi, q_min_mass, q_min_conf],
        questions,
        api_visibility="private",
        concurrency_limit=None,
    )


# ==================================================================================================================
# The API
# ==================================================================================================================


def _refuse(exc: Exception) -> gr.Error:
    """A refused request as the gr.Error a client receives (its message survives a ZeroGPU worker)."""
    title = "Busy" if isinstance(exc, blink.BlinkBusy) else "Bad request"
    return gr.Error(error_text(exc), title=title, print_exception=False)


# The docstrings of the API functions are also their MCP tool descriptions: Gradio reads each parameter's description
# from its own line under Args, so those lines stay whole however long.
def decide(
    state: str | dict | list,
    questions: str | dict,
    temperature: float | None = None,
    model: str = "",
    prefer: str = "live",
    images: list | None = None,
) -> dict:
    """Answer typed questions about some evidence with a language model in one forward pass: each answer is read
    from the model's next-token probabilities over the options, no text is generated. Question types: choice (pick
    one of 1-255 options), noul (the probability of yes), score (2-10 ordered levels -> expected level).

    Args:
        state: the evidence: text, JSON text, or a JSON object or array.
        questions: {name: question}, an object or JSON text. A question is {"type": "choice", "instructions": "...", "criteria": ["a", "b"] or {"a": "what a means"}}, {"type": "noul", "instructions": "...", "criteria": {"true": "what counts as yes"}} or {"type": "score", "instructions": "...", "criteria": ["lowest level", "...", "highest level"]}.
        temperature: softmax temperature over the option labels, above 0; leave it out (null) for the deployment's calibrated or default one.
        model: which served model answers; "" for the default (the info tool lists them).
        prefer: "live" runs the model; "saved" lets a bundled example come from its recording.
        images: image data URIs (data:image/png;base64,...) for a vision model, shown after the state.

    Returns:
        {answers, meta}: per question, choice {choice, confidence, probabilities}, noul {noul: p(yes), probabilities}, score {score, probabilities, legend}; meta names the model and engine and counts tokens.
    """  # noqa: E501 (read whole: a tool description and a template)
    try:
        return DEPLOYMENT.submit(parse_request(state, questions, temperature, images, prefer), model)
    except (blink.BlinkError, blink.BlinkBusy) as exc:
        raise _refuse(exc) from None
    except gr.Error:  # ZeroGPU's own refusals (over quota, no GPU free) reach the caller as they are
        raise
    except Exception as exc:  # noqa: BLE001 - a message, never a traceback
        log.exception("request failed")
        raise gr.Error(f"the model failed on this request ({type(exc).__name__})", print_exception=False) from None


def batch_item(result) -> dict:
    """One /decide_batch result as the caller reads it: the answer, or {error, loc} for a refused request."""
    if isinstance(result, (blink.BlinkError, blink.BlinkBusy)):
        return {"error": error_text(result), "loc": result.loc}
    if isinstance(result, gr.Error):  # ZeroGPU's own refusal (over quota, no GPU free)
        return {"error": f"{result.title}: {result.message}", "loc": []}
    if isinstance(result, Exception):
        log.error("batch item failed: %r", result)
        return {"error": f"the model failed on this request ({type(result).__name__})", "loc": []}
    return result


def decide_batch(requests: list | str, temperature: float | None = None, model: str = "") -> list:
    """Answer several requests in one call, packed into shared forward passes (the decide tool, for many pieces of
    evidence at once).

    Args:
        requests: a list of up to 64 {"state": ..., "questions": {...}} objects, each as decide takes them.
        temperature: softmax temperature over the option labels, above 0; leave it out (null) for the deployment's calibrated or default one.
        model: which served model answers; "" for the default.

    Returns:
        one item per request, in order: {answers, meta}, or {error, loc} for a request that was refused (the others are still answered).
    """  # noqa: E501 (read whole: a tool description and a template)
    try:
        model = DEPLOYMENT.model_id(model)
        results = DEPLOYMENT.submit_many(DEPLOYMENT.parse_many(requests, temperature), model)
    except blink.BlinkError as exc:
        raise _refuse(exc) from None
    except Exception as exc:  # noqa: BLE001 - a message, never a traceback
        log.exception("batch failed")
        raise gr.Error(f"the model failed on this batch ({type(exc).__name__})", print_exception=False) from None
    return [
        batch_item(blink.within_batch(res, i) if isinstance(res, blink.BlinkError) else res)
        for i, res in enumerate(results)
    ]


def info() -> dict:
    """What this deployment serves: its models (the default first), each model's engine and recording, and the
    bundled example requests (each a ready state and questions for the decide tool)."""
    recordings = {m: DEPLOYMENT.recording(m) for m in DEPLOYMENT.models()}
    return {
        "models": DEPLOYMENT.models(),
        "default_model": DEPLOYMENT.default_model,
        "engines": {m: DEPLOYMENT.engine_kind(m) for m in DEPLOYMENT.models()},
        "compute": {m: DEPLOYMENT.engine(m).compute for m in DEPLOYMENT.models()},  # backend, dtype, kernel
        "recordings": {m: rec.header() if rec else None for m, rec in recordings.items()},
        "presets": [
            {"name": n, "description": ex.get("description", ""), "state": ex["state"], "questions": ex["questions"]}
            for n, ex in PRESETS.items()
        ],
    }


# ==================================================================================================================
# Launch
# ==================================================================================================================


def build_demo() -> space.Space:
    """The Blocks app: the page, the named API endpoints, and a queue that lets concurrent requests batch; its theme,
    CSS and HTTP layer come with it however it is served (adapters/space.py)."""
    with space.Space(HTTP, CSS, gr.themes.Soft(), title="blink — typed decisions") as demo:
        build_page()
        gr.api(decide, api_name="decide")
        gr.api(decide_batch, api_name="decide_batch")
        gr.api(info, api_name="info", concurrency_limit=None)
    # Gradio's default lets one event run at a time (and on ZeroGPU queues only one): the Batcher needs company.
    demo.queue(default_concurrency_limit=SERVER.concurrency, max_size=SERVER.queue_size)
    return demo


def start() -> space.Space:
    """Read the recordings and build every served model now (on ZeroGPU the weights are placed on the device at
    start), then the page. A deployment that cannot serve (a corrupt or foreign recording, a model whose labels do
    not verify) stops here with one line naming the problem, not a traceback."""
    for mid in DEPLOYMENT.models():
        try:
            DEPLOYMENT.engine(mid)
        except blink.BlinkError as exc:
            raise SystemExit(f"blink: cannot serve {mid}: {exc}") from None
    return build_demo()


@functools.cache
def built_demo() -> space.Space:
    """The page and its models, built once, on first use: importing app.py builds nothing, launching does."""
    return start()


def __getattr__(name: str):
    """`app.demo`, the Blocks app Gradio's tools look for (reload mode, gr.mount_gradio_app), built on first access:
    the whole app, served however it is started."""
    if name == "demo":
        return built_demo()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def launch(**kwargs):
    """Build the models and the page, then start the server (Gradio's launch with `kwargs`): the page, the API (also
    as MCP tools, where MCP runs) and the HTTP layer's routes on one port."""
    return built_demo().launch(**kwargs)


if __name__ == "__main__":
    launch()
