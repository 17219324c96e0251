"""blink's wire protocols: TypeSafe's System One API and OpenAI's Decisions API, translated into a blink Request and
back. A server (app.py) reads the body, then calls <protocol>.call -> Deployment.submit -> <protocol>.response; this
module imports blink and neither FastAPI nor Gradio.

  System One (TypeSafe, client typesafe-sdk): POST /v1/systemone {model, state, questions, assets?} ->
    {model, answers: {name: answer}, usage}; GET /v1/models -> {models: [{name, description, release_date}]}.
    Images come as `assets` keyed by a placeholder that stands in the state, instructions or criteria (JSON
    data_base64, or a multipart part the SDK sends: a `request` JSON part plus `asset-N` parts).
  System One batch (laya-serve's): POST /v1/systemone/batch {model?, states: [1-64], questions, assets?} ->
    {results: [one System One response per state]}; refused whole, naming the state, when one state cannot be asked.
  OpenAI Decisions (client openai >= 3.26): POST /v1/decisions {model, input, questions: [...]} ->
    {model, answers: [... in question order], usage}.

Answers use the field's formulas: choice confidence (p_max - 1/n) / (1 - 1/n); score confidence
max(0, 1 - sum_i p_i |i - mode| / (sum_i |i - (n-1)/2| / n)); blink's own decide() keeps the reference design's
formulas. Each answer holds its protocol's standard fields only, so a strict client or a schema that forbids other
fields (krite-bench's response schema) reads it; what blink adds goes in one place, the reply's `x_meta`: its
`/decide` meta, and under `x_meta.answers`, keyed by question (System One's key; a Decisions question's position),
each answer's extras (label mass, rotations, multi's p(yes) per option, abstention). An abstained or multi answer
keeps every standard field.
"""

from __future__ import annotations

import base64
import hmac
import importlib
import json
import os
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import blink

DEFAULT_MODEL_ALIAS = "jev-latest"  # the System One SDKs' default model: answered by the default model
_JSON_KINDS = {str: "a string", dict: "an object", list: "an array", bool: "a boolean"}
TEXTLIKE = (str, dict, list)  # instructions and descriptions: text, or structured as an object or an array
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
_IMAGE_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"))
DECISION_TYPES = {"predicate": "noul", "choice": "choice", "score": "score"}  # Decisions type -> blink type
DECISION_PARTS = {
    "user": ("input_text", "input_image", "input_json"),
    "developer": ("input_text",),
    "system": ("input_text",),
    "assistant": ("output_text", "refusal"),
}
DECISION_ITEMS = ("function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output")
BLINK_EXTRAS = (
    "label_mass",
    "rotations",
    "rotation_choices",
    "order_sensitivity",
    "multi",
    "choices",
    "abstained",
    "reason",
)  # answer fields blink adds, sent under x_meta.answers.<question> (with a multi question's p_yes)


class WireError(blink.BlinkError):
    """A refused wire request: its HTTP status and error type (422 "value_error" and the like are field-level
    validation errors), and `retry_after` seconds when trying again later can help."""

    def __init__(
        self,
        message: str,
        loc: list | None = None,
        status: int = 422,
        kind: str = "value_error",
        retry_after: float | None = None,
    ):
        super().__init__(message, loc)
        self.status, self.kind, self.retry_after = status, kind, retry_after


@dataclass(frozen=True)
class WireCall:
    """A wire request in blink's terms: the served model that answers it, the parsed Request, and the questions as
    the protocol sent them (answers are shaped from them: System One's legends, Decisions' names and values)."""

    model: str
    request: blink.Request
    sent: dict | list


def _field(loc: list) -> str:
    """A body location as people read it: ['body', 'questions', 'q', 'type'] -> 'questions.q.type'."""
    return blink.field_name(loc) or "the body"


def _need(obj: dict, name: str, loc: list):
    """A required field's value, or a 422 naming it."""
    if name not in obj:
        raise WireError(f"{_field([*loc, name])} is required", [*loc, name], kind="missing")
    return obj[name]


def _typed(value, kinds: tuple, loc: list, nullable: bool = False):
    """The value when it is of one of the JSON kinds, else a 422 saying what the field takes."""
    if (value is None and nullable) or isinstance(value, kinds):
        return value
    want = " or ".join(_JSON_KINDS[k] for k in kinds) + (" or null" if nullable else "")
    raise WireError(f"{_field(loc)} must be {want} (got {type(value).__name__})", loc, kind="type_error")


def wire_model(model, deployment: blink.Deployment) -> str:
    """The served model a wire request names (the default model's alias maps to it; the deployment's own check
    does the rest), or a 404 naming the served ones."""
    if model == DEFAULT_MODEL_ALIAS:
        return deployment.default_model
    try:
        if model.strip():  # the deployment reads '' as its default; the wire names a model
            return deployment.model_id(model)
    except blink.BlinkError:
        pass
    raise WireError(
        f"model {model!r:.80} is not served here; this deployment serves {', '.join(deployment.models())} "
        f"({DEFAULT_MODEL_ALIAS!r} answers with {deployment.default_model})",
        ["body", "model"],
        404,
        "model_not_found",
    )


def wire_json(data: bytes):
    """A request body parsed as strict JSON (no NaN or Infinity), or a 422 saying where it breaks."""

    def constant(name: str):
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(data, parse_constant=constant)
    except json.JSONDecodeError as exc:
        raise WireError(
            f"the body is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
            ["body", exc.pos],
            kind="json_invalid",
        ) from None
    except RecursionError:
        raise WireError("the body nests too deep to read", ["body"], kind="json_invalid") from None
    except ValueError as exc:  # bytes that are not UTF-8 text, NaN or Infinity, an integer of too many digits
        raise WireError(f"the body is not valid JSON: {exc}", ["body"], kind="json_invalid") from None


def zstd_module():
    """The zstd codec: compression.zstd (Python 3.14) or the backports.zstd package; None when neither is here."""
    for name in ("compression.zstd", "backports.zstd"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def body_too_large(limit: int, what: str = "request body") -> WireError:
    """The refusal of a body over BLINK_MAX_BODY_BYTES."""
    return WireError(f"the {what} is over {limit} bytes (BLINK_MAX_BODY_BYTES)", ["body"], 413, "request_too_large")


def decoded_body(data: bytes, encoding: str, limit: int) -> bytes:
    """A request body with its Content-Encoding undone: none, or zstd (what typesafe-sdk sends for bodies of 1 KiB and
    more when zstd is available), decompressed frame by frame and never past `limit` bytes."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return data
    if encoding != "zstd":
        raise WireError(
            f"Content-Encoding {encoding!r:.40} is not supported: send the body as it is, or as zstd",
            ["body"],
            415,
            "unsupported_media_type",
        )
    zstd = zstd_module()
    if zstd is None:
        raise WireError(
            "this server cannot read zstd bodies (it lacks backports.zstd): send the body uncompressed "
            "(typesafe-sdk: compression=False)",
            ["body"],
            415,
            "unsupported_media_type",
        )
    out = bytearray()
    while data:
        frame = zstd.ZstdDecompressor()
        try:
            out += frame.decompress(data, max_length=limit + 1 - len(out))
        except zstd.ZstdError as exc:
            raise WireError(f"the zstd body cannot be decompressed: {exc}", ["body"], 400, "invalid_request") from None
        if len(out) > limit:
            raise body_too_large(limit, "decompressed request body")
        if not frame.eof:
            raise WireError("the zstd body ends in the middle of a frame", ["body"], 400, "invalid_request")
        data = frame.unused_data
    return bytes(out)


def check_bearer(authorization: str, key: str | None) -> None:
    """With a deployment key (BLINK_API_KEY), the Authorization header must be `Bearer <key>` (compared in constant
    time; the key never appears in a reply or a log); without one any header is accepted."""
    if key is None:
        return
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise WireError(
            "missing or wrong API key: send the deployment's key as Authorization: Bearer <key>",
            [],
            401,
            "authentication_error",
        )


def media_type(content_type: str) -> str:
    """A Content-Type header's media type, lowercased, without parameters."""
    return content_type.split(";")[0].strip().lower()


def is_multipart(content_type: str) -> bool:
    """True for a multipart form (typesafe-sdk's requests with images)."""
    return media_type(content_type) == "multipart/form-data"


def request_body(data: bytes, content_type: str):
    """A decoded, non-multipart body as the request object: JSON (application/json, +json, or no type given), or a
    415 naming the type."""
    kind = media_type(content_type)
    if kind and kind != "application/json" and not kind.endswith("+json"):
        raise WireError(
            f"Content-Type {kind!r:.60} is not supported: send application/json (or multipart/form-data with images)",
            ["body"],
            415,
            "unsupported_media_type",
        )
    return wire_json(data)


def form_body(parts: dict[str, bytes]) -> tuple[object, dict[str, bytes]]:
    """A multipart form's parts as (the JSON `request` part, the other parts by name: images)."""
    parts = dict(parts)
    if "request" not in parts:
        raise WireError(
            "the multipart body needs a `request` part holding the JSON request", ["body", "request"], kind="missing"
        )
    return wire_json(parts.pop("request")), parts


# ---- images: System One assets and Decisions image parts become data URIs blink's image rules read --------------


def _sniffed_mime(raw: bytes) -> str | None:
    """The image type of some bytes, from their signature: PNG, JPEG or WebP."""
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "image/webp"
    return next((mime for magic, mime in _IMAGE_MAGIC if raw.startswith(magic)), None)


def _asset_uri(key: str, asset, parts: Mapping[str, bytes], claimed: set, limits: blink.ImageLimits) -> str:
    """One System One asset (inline data_base64, or the multipart part it names) as a data URI, its type detected
    from its bytes; a 422 naming the asset otherwise."""
    loc = ["body", "assets", key]
    _typed(asset, (dict,), loc)
    if asset.get("type") not in (None, "image"):
        raise WireError(f"asset {key!r}: type must be image", [*loc, "type"])
    if asset.get("format") not in (None, "png", "jpg", "jpeg"):
        raise WireError(f"asset {key!r}: format must be png, jpg or jpeg", [*loc, "format"])
    part = _typed(asset.get("part"), (str,), [*loc, "part"], nullable=True)
    if part is not None:
        if part not in parts:
            raise WireError(f"asset {key!r}: the request has no multipart part named {part!r:.80}", [*loc, "part"])
        if part in claimed:
            raise WireError(f"asset {key!r}: part {part!r:.80} is claimed by another asset", [*loc, "part"])
        claimed.add(part)
        raw = parts[part]
        size, head, payload = len(raw), raw[:16], None
    else:
        data = _typed(asset.get("data_base64"), (str,), [*loc, "data_base64"], nullable=True)
        if data is None:
            raise WireError(
                f"asset {key!r} needs data_base64 or a multipart part", [*loc, "data_base64"], kind="missing"
            )
        payload = "".join(data.split())
        if len(payload) % 4 or not _BASE64.fullmatch(payload):
            raise WireError(f"asset {key!r}: data_base64 is not valid base64", [*loc, "data_base64"])
        # checked, not decoded: its size from its length, its type from its first bytes; blink decodes it once
        size, head = len(payload) * 3 // 4 - payload[-2:].count("="), base64.b64decode(payload[:24])
    if not size or size > limits.max_bytes:
        raise WireError(f"asset {key!r} must be an image of 1 to {limits.max_bytes} bytes", loc)
    mime = _sniffed_mime(head)
    if mime is None:
        raise WireError(f"asset {key!r} is not a PNG, JPEG or WebP image", loc)
    return f"data:{mime};base64,{payload or base64.b64encode(raw).decode('ascii')}"


def asset_uris(assets, parts: Mapping[str, bytes], engine: blink.Engine) -> dict[str, str]:
    """Every System One asset as a data URI, by its placeholder; refused (naming the asset) when the model reads
    text only, and when a multipart image part is claimed by no asset."""
    if assets is None:
        unclaimed = sorted(parts)
        if unclaimed:
            raise WireError(f"multipart part {unclaimed[0]!r:.80} is claimed by no asset", ["body", "assets"])
        return {}
    _typed(assets, (dict,), ["body", "assets"])
    if not assets:
        raise WireError("assets, when given, must hold at least one asset", ["body", "assets"], kind="too_short")
    if "" in assets:  # a placeholder must be something that can stand in the text
        raise WireError("asset names must be non-empty", ["body", "assets", ""])
    first = next(iter(assets))
    if not engine.reads_images:
        raise WireError(
            f"asset {first!r}: this model reads text only, so it cannot take images", ["body", "assets", first]
        )
    claimed: set = set()
    uris = {key: _asset_uri(key, asset, parts, claimed, engine.image_limits) for key, asset in assets.items()}
    unclaimed = sorted(set(parts) - claimed)
    if unclaimed:
        raise WireError(f"multipart part {unclaimed[0]!r:.80} is claimed by no asset", ["body", "assets"])
    return uris


def _image_uri_count(state) -> int:
    """How many image data URIs stand in the state (blink numbers them [image 1], [image 2], ... in this order)."""
    return sum(
        1 for value, _ in blink.state_strings(state) for _, _, error in blink.scan_image_uris(value) if error is None
    )


def _replace_in_texts(value, pattern: re.Pattern, replace: Callable):
    """A copy of instructions or criteria with every placeholder inside a string replaced (object keys, the option
    names, stay as they are)."""
    return blink.map_values(value, [], lambda v, _loc: pattern.sub(replace, v) if isinstance(v, str) else v)


def place_assets(state, questions: dict, uris: dict[str, str]) -> tuple[object, dict, list[str]]:
    """Each asset where its placeholder stands: inside the state the image itself (a data URI read where it stands);
    inside instructions and criteria its name as the model sees it, [image N]. An asset the state does not hold is
    listed after the state. Returns (state, questions, listed images)."""
    if not uris:
        return state, questions, []
    pattern = re.compile("|".join(map(re.escape, sorted(uris, key=len, reverse=True))))
    numbers: dict[str, int] = {}
    count = 0

    def place(value, _loc):
        nonlocal count
        if not isinstance(value, str):
            return value
        found = [(m.start(), m.group()) for m in pattern.finditer(value)]
        found += [(start, None) for start, _, error in blink.scan_image_uris(value) if error is None]
        for _, key in sorted(found, key=lambda hit: hit[0]):
            count += 1
            if key is not None:
                numbers.setdefault(key, count)
        return pattern.sub(lambda m: uris[m.group()], value)

    state = blink.map_values(state, ["body", "state"], place)
    listed = [key for key in uris if key not in numbers]
    numbers.update({key: count + i for i, key in enumerate(listed, 1)})
    name = lambda m: f"[image {numbers[m.group()]}]"  # noqa: E731
    placed = {}
    for qkey, q in questions.items():
        q = dict(q)
        for part in ("instructions", "criteria"):
            if q.get(part) is not None:
                q[part] = _replace_in_texts(q[part], pattern, name)
        placed[qkey] = q
    return state, placed, [uris[key] for key in listed]


# ---- System One ------------------------------------------------------------------------------------------------


def _systemone_question(key: str, q) -> None:
    """One System One question checked against the wire schema (blink's own parser checks everything else)."""
    loc = ["body", "questions", key]
    _typed(q, (dict,), loc)
    qtype = _need(q, "type", loc)
    if qtype == "box":
        raise WireError(
            f"question {key!r}: box questions (locating a region of an image) are not supported; blink "
            "answers noul, choice and score questions",
            [*loc, "type"],
            400,
            "unsupported_question_type",
        )
    if qtype not in blink.QUESTION_TYPES:
        raise WireError(
            f"question {key!r}: type must be noul, choice, score or box (got {qtype!r:.80})",
            [*loc, "type"],
            kind="union_tag_invalid",
        )
    _typed(q.get("instructions"), TEXTLIKE, [*loc, "instructions"], nullable=True)
    crit_loc = [*loc, "criteria"]
    if qtype == "noul":
        criteria = _typed(q.get("criteria"), (dict,), crit_loc, nullable=True) or {}
        for side in ("true", "false"):
            _typed(criteria.get(side), TEXTLIKE, [*crit_loc, side], nullable=True)
    elif qtype == "choice":
        for option, description in _typed(_need(q, "criteria", loc), (dict,), crit_loc).items():
            _typed(description, TEXTLIKE, [*crit_loc, option], nullable=True)
    else:
        for i, level in enumerate(_typed(_need(q, "criteria", loc), (list,), crit_loc)):
            _typed(level, TEXTLIKE, [*crit_loc, i])


def whole_permute(q: dict) -> dict:
    """A question with a `permute` of 3.0 read as 3 (JSON has one kind of number: 3.0 is a whole number of
    rotations, as a JSON Schema integer is)."""
    n = q.get("permute")
    if isinstance(n, float) and n.is_integer():
        return {**q, "permute": int(n)}
    return q


def _systemone_questions(body: dict) -> dict:
    """A System One body's questions, each checked against the wire schema."""
    questions = _typed(_need(body, "questions", ["body"]), (dict,), ["body", "questions"])
    if not questions:
        raise WireError("questions must hold at least one question", ["body", "questions"], kind="too_short")
    for key, q in questions.items():
        _systemone_question(key, q)
    return {key: whole_permute(q) for key, q in questions.items()}


def _state_call(model: str, state, questions: dict, uris: dict, deployment: blink.Deployment) -> WireCall:
    """One state and its questions (assets placed) parsed into a WireCall under the deployment's limits."""
    state, placed, listed = place_assets(state, questions, uris)
    return WireCall(model, deployment.request(state, placed, images=listed or None), questions)


def systemone_call(body, parts: Mapping[str, bytes], deployment: blink.Deployment) -> WireCall:
    """A System One body (with the image parts of its multipart form, if any) checked and parsed into blink's
    terms; WireError or BlinkError naming the field otherwise."""
    _typed(body, (dict,), ["body"])
    model = wire_model(_typed(_need(body, "model", ["body"]), (str,), ["body", "model"]), deployment)
    state = _typed(_need(body, "state", ["body"]), TEXTLIKE, ["body", "state"])
    questions = _systemone_questions(body)
    uris = asset_uris(body.get("assets"), parts, deployment.engine(model))
    return _state_call(model, state, questions, uris, deployment)


# ---- System One batch (laya-serve's POST /v1/systemone/batch) ----------------------------------------------------

MAX_BATCH_STATES = blink.MAX_BATCH_REQUESTS  # states in one batch request (laya-serve's limit: 64)


@dataclass(frozen=True)
class WireBatch:
    """A batch request in blink's terms: the served model and one WireCall per state, in order."""

    model: str
    calls: list[WireCall]


def in_state(exc: Exception, i: int) -> Exception:
    """State i's refusal located inside its batch: a location in the state (or none) moves under `states[i]`, and
    the message names the state; a refusal of the shared questions or of the request as a whole (busy, a model
    failure) passes as it is."""
    if not isinstance(exc, blink.BlinkError) or not (exc.loc[:2] == ["body", "state"] or len(exc.loc) <= 1):
        return exc  # the batch as a whole, or its shared questions, named as they are
    loc = ["body", "states", i, *exc.loc[2:]]
    message = f"states[{i}]: {exc}"
    if isinstance(exc, WireError):
        return WireError(message, loc, exc.status, exc.kind, exc.retry_after)
    return type(exc)(message, loc) if isinstance(exc, blink.ReplayMiss) else blink.BlinkError(message, loc)


def systemone_batch_call(body, parts: Mapping[str, bytes], deployment: blink.Deployment) -> WireBatch:
    """A batch body, {model?, states: [1-MAX_BATCH_STATES states], questions, assets?}: one question set asked of
    every state (laya-serve's shape; `model` defaults to the SDKs' default alias). Checked and parsed whole: the
    first state that cannot be asked refuses the request, naming it (states[i])."""
    _typed(body, (dict,), ["body"])
    model = wire_model(_typed(body.get("model", DEFAULT_MODEL_ALIAS), (str,), ["body", "model"]), deployment)
    states = _typed(_need(body, "states", ["body"]), (list,), ["body", "states"])
    if not 1 <= len(states) <= MAX_BATCH_STATES:
        raise WireError(
            f"states: give 1 to {MAX_BATCH_STATES} states (got {len(states)})",
            ["body", "states"],
            kind="too_short" if not states else "too_long",
        )
    questions = _systemone_questions(body)
    uris = asset_uris(body.get("assets"), parts, deployment.engine(model))
    calls = []
    for i, state in enumerate(states):
        try:
            _typed(state, TEXTLIKE, ["body", "state"])
            calls.append(_state_call(model, state, questions, uris, deployment))
        except blink.BlinkError as exc:
            raise in_state(exc, i) from None
    return WireBatch(model, calls)


def systemone_batch_response(batch: WireBatch, results: list) -> dict:
    """{results: [one System One response per state, in order]} (laya-serve's shape); the first state whose answer
    failed refuses the request, naming the state."""
    for i, result in enumerate(results):
        if isinstance(result, Exception):
            raise in_state(result, i)
    return {"results": [systemone_response(call, result) for call, result in zip(batch.calls, results)]}


def score_confidence(dist: list[float]) -> float:
    """The field's score confidence: one minus the expected distance from the most likely level, over that distance
    for a uniform distribution around the middle level; 0 when the answer is as spread as that or more."""
    n = len(dist)
    mode = max(range(n), key=lambda i: (dist[i], -i))
    spread = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
    return max(0.0, 1 - sum(p * abs(i - mode) for i, p in enumerate(dist)) / spread)


def answer_extras(question: blink.Question, answer: dict) -> dict:
    """What blink adds to one answer (BLINK_EXTRAS it holds, and a multi question's p(yes) per option as p_yes):
    the reply's x_meta.answers entry for the question."""
    extras = {name: answer[name] for name in BLINK_EXTRAS if name in answer}
    if question.multi:
        extras["p_yes"] = dict(answer["probabilities"])
    return extras


def field_answer(question: blink.Question, answer: dict) -> tuple[str, float, list[float]]:
    """A blink answer in the field's terms: (the pick, its confidence by the field's formula, the distribution in
    request order). A multi question's distribution is its p(yes) per option normalised; an abstained answer keeps
    its pick here (x_meta.answers says it abstained)."""
    keys = question.keys
    dist = [answer["probabilities"][k] for k in keys]
    if question.multi:
        total = sum(dist) or 1.0
        dist = [p / total for p in dist]
    confidence = score_confidence(dist) if question.type == "score" else blink.choice_confidence(max(dist), len(keys))
    return blink.top_key(keys, dist), confidence, dist


def expected_level(dist: list[float]) -> float:
    """A score: the probability-weighted mean level."""
    return sum(i * p for i, p in enumerate(dist))


def systemone_answer(question: blink.Question, answer: dict, sent: dict) -> dict:
    """One answer in System One's shape, its standard fields only (a score's legend echoes each level as sent)."""
    pick, confidence, dist = field_answer(question, answer)
    probs = dict(zip(question.keys, dist))
    if question.type == "noul":
        return {"type": "noul", "noul": probs["yes"]}
    if question.type == "choice":
        return {"type": "choice", "choice": pick, "confidence": confidence, "probabilities": probs}
    return {
        "type": "score",
        "score": expected_level(dist),
        "confidence": confidence,
        "legend": {str(i): level for i, level in enumerate(sent["criteria"])},
        "probabilities": probs,
    }


def wire_meta(call: WireCall, result: dict) -> dict:
    """A reply's x_meta: blink's meta, and under `answers` each question's extras keyed as blink keys the question
    (System One's key; a Decisions question's position)."""
    extras = {q.key: answer_extras(q, result["answers"][q.key]) for q in call.request.questions}
    return {**result["meta"], "answers": extras}


def systemone_response(call: WireCall, result: dict) -> dict:
    """The System One response of an answered request: standard answers, blink's additions in x_meta."""
    answers = {q.key: systemone_answer(q, result["answers"][q.key], call.sent[q.key]) for q in call.request.questions}
    return {
        "model": call.model,
        "answers": answers,
        "usage": {"input_tokens": int(result["meta"]["input_tokens"]), "output_tokens": 0},
        "x_meta": wire_meta(call, result),
    }


# ---- OpenAI Decisions ------------------------------------------------------------------------------------------


def _decision_image(part: dict, loc: list) -> str:
    """An input_image part's image: a data URL blink reads (http(s) URLs and file ids are not fetched)."""
    url = _typed(_need(part, "image_url", loc), (str,), [*loc, "image_url"])
    if not url[:11].lower().startswith(blink.IMAGE_PREFIX):
        raise WireError(
            f"{_field([*loc, 'image_url'])}: images must be sent as data URLs (data:image/png;base64,"
            "...); URLs and file ids are not fetched",
            [*loc, "image_url"],
            400,
            "unsupported_image_url",
        )
    return url


def _decision_content(content, role: str, loc: list) -> str | list:
    """A message's content as evidence: its text (parts joined by lines), or, with images or JSON data among its
    parts, the list of them (an image as its data URL, read where it stands)."""
    if isinstance(content, str):
        return content
    out = []
    for i, part in enumerate(_typed(content, (list,), loc)):
        ploc = [*loc, i]
        kind = _need(_typed(part, (dict,), ploc), "type", ploc)
        if kind not in DECISION_PARTS[role]:
            raise WireError(
                f"{_field(ploc)}: a {role} message takes {', '.join(DECISION_PARTS[role])} parts (got {kind!r:.40})",
                [*ploc, "type"],
            )
        if kind == "input_image":
            out.append(_decision_image(part, ploc))
        elif kind == "input_json":
            out.append(_typed(_need(part, "data", ploc), (dict, list), [*ploc, "data"]))
        else:
            field_name = "refusal" if kind == "refusal" else "text"
            out.append(_typed(_need(part, field_name, ploc), (str,), [*ploc, field_name]))
    plain = all(isinstance(p, str) and not p[:11].lower().startswith(blink.IMAGE_PREFIX) for p in out)
    return "\n".join(out) if plain else out


def decision_state(value):
    """Decisions `input` as blink's evidence: text as it is; one user message as its content; several items as the
    list of {role, content} turns (tool calls and outputs as sent)."""
    loc = ["body", "input"]
    if isinstance(value, str):
        return value
    items = _typed(value, (list,), loc)
    if not items:
        raise WireError("input must be text or at least one input item", loc, kind="too_short")
    turns = []
    for i, item in enumerate(items):
        iloc = [*loc, i]
        _typed(item, (dict,), iloc)
        if "role" in item:
            role = item["role"]
            if not isinstance(role, str) or role not in DECISION_PARTS:
                raise WireError(
                    f"{_field([*iloc, 'role'])} must be user, developer, system or assistant", [*iloc, "role"]
                )
            turns.append(
                {"role": role, "content": _decision_content(_need(item, "content", iloc), role, [*iloc, "content"])}
            )
        elif item.get("type") in DECISION_ITEMS:
            turns.append({k: v for k, v in item.items() if v is not None})
        else:
            raise WireError(
                f"{_field(iloc)} must be a message (with a role) or one of {', '.join(DECISION_ITEMS)}", iloc
            )
    if len(turns) == 1 and turns[0].get("role") == "user":
        return turns[0]["content"]
    return turns


def _decision_instructions(value, loc: list, images: list, first_number: int) -> str:
    """A question's instructions as text; an input_image part is listed after the state and named [image N]."""
    if isinstance(value, str):
        return value
    lines = []
    for i, part in enumerate(_typed(value, (str, list), loc)):
        ploc = [*loc, i]
        kind = _need(_typed(part, (dict,), ploc), "type", ploc)
        if kind == "input_text":
            lines.append(_typed(_need(part, "text", ploc), (str,), [*ploc, "text"]))
        elif kind == "input_image":
            images.append(_decision_image(part, ploc))
            lines.append(f"[image {first_number + len(images) - 1}]")
        else:
            raise WireError(
                f"{_field(ploc)}: instructions take input_text and input_image parts (got {kind!r:.40})",
                [*ploc, "type"],
            )
    return "\n".join(lines)


def _decision_options(q: dict, kind: str, loc: list) -> dict | list:
    """A choice's {key: description} (a boolean value keyed by its JSON text) or a score's level texts."""
    name, high = ("choices", blink.MAX_OPTIONS) if kind == "choice" else ("levels", blink.MAX_LEVELS)
    items = _typed(_need(q, name, loc), (list,), [*loc, name])
    if not 2 <= len(items) <= high:
        raise WireError(f"{_field([*loc, name])}: give 2 to {high} {name} (got {len(items)})", [*loc, name])
    options: dict = {}
    levels = []
    for j, item in enumerate(items):
        oloc = [*loc, name, j]
        _typed(item, (dict,), oloc)
        description = _typed(item.get("description"), (str,), [*oloc, "description"], nullable=True)
        if kind == "score":
            label = _typed(_need(item, "label", oloc), (str,), [*oloc, "label"])
            levels.append(f"{label}: {description}" if description else label)
            continue
        value = _typed(_need(item, "value", oloc), (str, bool), [*oloc, "value"])
        key = json.dumps(value) if isinstance(value, bool) else value
        if key in options:
            raise WireError(f"{_field([*oloc, 'value'])}: {key!r:.80} is offered twice", [*oloc, "value"])
        options[key] = description
    return options if kind == "choice" else levels


def decisions_call(body, parts: Mapping[str, bytes], deployment: blink.Deployment) -> WireCall:
    """A Decisions body checked and parsed into blink's terms (each question keyed by its position); WireError or
    BlinkError naming the field otherwise. Decisions bodies are JSON only: `parts` must be empty."""
    _typed(body, (dict,), ["body"])
    if parts:
        raise WireError("Decisions requests are JSON, not multipart", ["body"], 415, "unsupported_media_type")
    model = wire_model(_typed(_need(body, "model", ["body"]), (str,), ["body", "model"]), deployment)
    state = decision_state(_need(body, "input", ["body"]))
    sent = _typed(_need(body, "questions", ["body"]), (list,), ["body", "questions"])
    if not sent:
        raise WireError("questions must hold at least one question", ["body", "questions"], kind="too_short")
    images: list[str] = []
    in_state = _image_uri_count(state)
    questions = {}
    for i, q in enumerate(sent):
        loc = ["body", "questions", i]
        kind = _need(_typed(q, (dict,), loc), "type", loc)
        if not isinstance(kind, str) or kind not in DECISION_TYPES:
            raise WireError(
                f"{_field([*loc, 'type'])} must be predicate, choice or score (got {kind!r:.80})",
                [*loc, "type"],
                kind="union_tag_invalid",
            )
        _typed(q.get("name"), (str,), [*loc, "name"], nullable=True)
        spec = {
            "type": DECISION_TYPES[kind],
            "instructions": _decision_instructions(
                _need(q, "instructions", loc), [*loc, "instructions"], images, in_state + 1
            ),
        }
        if kind != "predicate":
            spec["criteria"] = _decision_options(q, kind, loc)
        spec.update({k: v for k, v in whole_permute(q).items() if k in ("permute", "multi", "abstain")})  # opt-ins
        questions[str(i)] = spec
    return WireCall(model, deployment.request(state, questions, images=images or None), sent)


def decision_answer(question: blink.Question, answer: dict, sent: dict) -> dict:
    """One answer in the Decisions shape, named as the question was (null when unnamed), its standard fields only."""
    pick, confidence, dist = field_answer(question, answer)
    head = {"type": sent["type"], "name": sent.get("name")}
    if question.type == "noul":
        return {**head, "probability": dist[0]}
    if question.type == "choice":
        values = [c["value"] for c in sent["choices"]]
        return {
            **head,
            "choice": values[question.keys.index(pick)],
            "confidence": confidence,
            "probabilities": [{"value": v, "probability": p} for v, p in zip(values, dist)],
        }
    return {
        **head,
        "score": expected_level(dist),
        "confidence": confidence,
        "probabilities": [
            {"value": i, "label": level["label"], "probability": p}
            for i, (level, p) in enumerate(zip(sent["levels"], dist))
        ],
    }


def cached_tokens(meta: dict) -> int:
    """Prompt tokens not computed for this request (the protocols' cached_tokens): read from a prefix kept by an
    earlier request, or computed in the same run on the account of a sibling question or another request; all of
    them where the model did not run for it (a recording's answer, the mock's)."""
    tokens = int(meta["input_tokens"])
    if "prefill_tokens" not in meta:
        return tokens
    return tokens - int(meta["prefill_tokens"] or 0)


def decisions_response(call: WireCall, result: dict) -> dict:
    """The Decisions response of an answered request, answers in question order; blink's additions in x_meta."""
    answers = [decision_answer(q, result["answers"][q.key], sent) for q, sent in zip(call.request.questions, call.sent)]
    meta = result["meta"]
    tokens = int(meta["input_tokens"])
    cached = cached_tokens(meta)
    usage = {
        "input_tokens": tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": tokens,
    }
    return {"model": call.model, "answers": answers, "usage": usage, "x_meta": wire_meta(call, result)}


# ---- errors and the models list -------------------------------------------------------------------------------


def wire_refusal(exc: Exception) -> WireError:
    """Any failure of a wire request as a WireError: a full queue is a 503 to retry after a second, a request the
    recording lacks on a recording-only host a 400, another BlinkError a 422 naming its field, and a failure inside
    the model a 500 that names only its type (the details stay in the server log)."""
    if isinstance(exc, WireError):
        return exc
    if isinstance(exc, blink.BlinkBusy):
        return WireError(str(exc), [], 503, "overloaded", retry_after=1)
    if isinstance(exc, blink.ReplayMiss):
        return WireError(str(exc), exc.loc, 400, "not_recorded")
    if isinstance(exc, blink.BlinkError):
        return WireError(str(exc), exc.loc)
    return WireError(f"the model failed on this request ({type(exc).__name__})", [], 500, "server_error")


def systemone_error(exc: Exception) -> tuple[int, dict]:
    """(status, body) of a refused System One request: 422 {detail: [{loc, msg, type}]} for a field, else
    {detail: {error_type, message}}."""
    err = wire_refusal(exc)
    if err.status == 422:
        return 422, {"detail": [{"loc": err.loc or ["body"], "msg": str(err), "type": err.kind}]}
    return err.status, {"detail": {"error_type": err.kind, "message": str(err)}}


_OPENAI_TYPES = {401: "authentication_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


def decisions_param(loc: list) -> str | None:
    """A body location as OpenAI names a parameter: ['body', 'questions', '2', 'criteria'] -> 'questions[2].choices'
    (blink keys each question by its position and calls options criteria; the evidence is `input`)."""
    out = ""
    for prev, part in zip(["body", *loc], loc[1:]):
        if prev == "questions" and (isinstance(part, int) or str(part).isdigit()) or isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + {"state": "input", "criteria": "choices"}.get(str(part), str(part))
    return out or None


def decisions_error(exc: Exception) -> tuple[int, dict]:
    """(status, body) of a refused Decisions request: {error: {message, type, param, code}} (a field-level refusal
    is a 400 invalid_request_error, as OpenAI's are)."""
    err = wire_refusal(exc)
    status = 400 if err.status == 422 else err.status
    return status, {
        "error": {
            "message": str(err),
            "type": _OPENAI_TYPES.get(status, "invalid_request_error"),
            "param": decisions_param(err.loc),
            "code": err.kind,
        }
    }


def weights_date(engine: blink.Engine) -> str:
    """The date (YYYY-MM-DD, UTC) of the served weights' config.json on this machine; "" when there is none (the
    mock, a recording)."""
    source, revision = engine.live.source, engine.live.revision
    if source is None:
        return ""
    path = os.path.join(source, "config.json")
    if not os.path.isfile(path):
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(source, "config.json", revision=revision)
    if not isinstance(path, str) or not os.path.isfile(path):
        return ""
    return time.strftime("%Y-%m-%d", time.gmtime(os.path.getmtime(path)))


def models_listing(deployment: blink.Deployment) -> dict:
    """GET /v1/models as the System One SDK reads it: every served model (the default first), then the default
    model's alias. release_date is the date of the served weights on this machine ("" when it has none)."""
    rows = []
    for mid in deployment.models():
        eng = deployment.engine(mid)
        what = "default model" if mid == deployment.default_model else "served model"
        rows.append(
            {
                "name": mid,
                "description": f"blink {what}, {eng.name} engine",
                "release_date": weights_date(eng),
                "x_engine": eng.name,
            }
        )
    default = rows[0]
    rows.append({**default, "name": DEFAULT_MODEL_ALIAS, "description": f"alias of {deployment.default_model}"})
    return {"models": rows}


@dataclass(frozen=True)
class WireProtocol:
    """One wire protocol: how a body becomes a WireCall, how an answer and a refusal are shaped, and the response
    header that carries the request id."""

    call: Callable[..., WireCall]
    response: Callable[[WireCall, dict], dict]
    error: Callable[[Exception], tuple[int, dict]]
    request_id_header: str


SYSTEM_ONE = WireProtocol(systemone_call, systemone_response, systemone_error, "x-typesafe-request-id")
DECISIONS = WireProtocol(decisions_call, decisions_response, decisions_error, "x-request-id")


def reply(protocol: WireProtocol, payload: dict | None, exc: Exception | None = None) -> tuple[int, dict, str]:
    """(status, headers, JSON text) of a wire reply: the answer, or the protocol's error body with its status
    (Retry-After when retrying helps, WWW-Authenticate on a 401); a request id header either way."""
    status, headers = 200, {protocol.request_id_header: f"req_{uuid.uuid4().hex}"}
    if exc is not None:
        err = wire_refusal(exc)
        status, payload = protocol.error(err)
        if err.retry_after is not None:
            headers["retry-after"] = f"{err.retry_after:g}"
        if err.status == 401:
            headers["www-authenticate"] = "Bearer"
    try:
        return status, headers, json.dumps(payload, ensure_ascii=False, allow_nan=False)
    except ValueError:  # a non-finite number from the model
        return reply(protocol, None, RuntimeError("the model returned a non-finite number"))
