"""The OpenAPI 3.1 document of blink's /v1 routes, as GET /openapi.json serves it (avrik-server serves one there).

Every schema here is built from what adapters/wire.py checks a body against and shapes a reply from: the question
types (blink.QUESTION_TYPES, wire.DECISION_TYPES), the limits (blink.MAX_OPTIONS, MAX_LEVELS, MAX_QUESTIONS,
wire.MAX_BATCH_STATES), the text-like kinds (wire.TEXTLIKE), the message parts (wire.DECISION_PARTS), the opt-in
features (blink.ABSTAIN_THRESHOLDS), the served models and the default alias, and whether a served model reads
images; a limit changed there changes the document. tests/test_field_routes.py validates the document with
openapi-spec-validator and every route's real replies, and refusals, against it with openapi-core;
tests/test_openapi_fuzz.py fuzzes the routes against it with schemathesis. This module imports blink and adapters/wire
only.
"""

from __future__ import annotations

import blink
from adapters import wire

OPENAPI_VERSION = "3.1.0"
_JSON_TYPES = {str: "string", dict: "object", list: "array", bool: "boolean"}


def ref(name: str) -> dict:
    """A reference to one of the document's component schemas."""
    return {"$ref": f"#/components/schemas/{name}"}


def text_like(nullable: bool = False) -> dict:
    """What wire.TEXTLIKE admits (text, or structured as an object or an array), null too when nullable."""
    kinds = [_JSON_TYPES[k] for k in wire.TEXTLIKE] + (["null"] if nullable else [])
    return {"type": kinds}


def evidence() -> dict:
    """A state: text that is not blank, or structured as an object or an array."""
    return non_blank(tuple(_JSON_TYPES[k] for k in wire.TEXTLIKE))


def probability() -> dict:
    """A probability."""
    return {"type": "number", "minimum": 0, "maximum": 1}


def obj(properties: dict, required: tuple = (), closed: bool = False, **more) -> dict:
    """An object schema; closed: no properties beyond those named."""
    out = {"type": "object", "properties": properties, **more}
    if required:
        out["required"] = list(required)
    if closed:
        out["additionalProperties"] = False
    return out


# every character str.strip() removes, listed (a regex engine's \s differs from Python's by a few)
WHITESPACE = "".join(c for c in map(chr, range(0x3001)) if c.isspace())


def non_blank(kinds: tuple = ("string",)) -> dict:
    """Text holding more than whitespace (blink refuses blank text), or a value of the other JSON kinds named."""
    return {"type": list(kinds) if len(kinds) > 1 else kinds[0], "pattern": f"[^{WHITESPACE}]"}


def blank() -> dict:
    """Text of whitespace only."""
    return {"type": "string", "pattern": f"^[{WHITESPACE}]*$"}


def blink_features(choice: bool) -> dict:
    """blink's opt-in question fields: permute and multi on a choice question (null, or multi false, elsewhere),
    abstain on any type (one threshold at least)."""
    thresholds = {name: probability() for name in blink.ABSTAIN_THRESHOLDS}
    out = {
        "permute": {
            "type": ["integer", "null"],
            "minimum": 1,
            "maximum": blink.MAX_OPTIONS,
            "description": "rotations of the options, at most one per option",
        },
        "multi": {"type": ["boolean", "null"]},
    }
    if not choice:
        out = {"permute": {"type": "null"}, "multi": {"enum": [False, None]}}
    abstain = {"type": ["object", "null"], "minProperties": 1, "properties": thresholds, "additionalProperties": False}
    return {**out, "abstain": abstain}


NOT_MULTI_AND_PERMUTE = {
    "not": {
        "properties": {"multi": {"const": True}, "permute": {"type": "integer"}},
        "required": ["multi", "permute"],
    }
}  # multi and permute cannot be combined (a multi question's options have no order)


def served_model(models: list[str]) -> dict:
    """A request's model: one of the served models, or the default model's alias."""
    return {
        "type": "string",
        "enum": [*models, wire.DEFAULT_MODEL_ALIAS],
        "description": f"a served model, or {wire.DEFAULT_MODEL_ALIAS!r} (the default model)",
    }


def question_names(schema: dict) -> dict:
    """A questions object whose names are non-empty."""
    return {**schema, "propertyNames": {"minLength": 1}}


def systemone_schemas(models: list[str], images: bool) -> dict:
    """System One's request, batch request, answers and replies; images: a served model reads them (else the
    request takes no assets)."""
    head = {"instructions": text_like(nullable=True)}
    questions = {
        "noul": obj(
            {
                "type": {"const": "noul"},
                **head,
                **blink_features(choice=False),
                "criteria": obj({"true": text_like(True), "false": text_like(True)}, type=["object", "null"]),
            },
            ("type",),
        ),
        "choice": obj(
            {
                "type": {"const": "choice"},
                **head,
                **blink_features(choice=True),
                "criteria": {
                    "type": "object",
                    "minProperties": 1,
                    "maxProperties": blink.MAX_OPTIONS,
                    "additionalProperties": text_like(nullable=True),
                },
            },
            ("type", "criteria"),
            **NOT_MULTI_AND_PERMUTE,
        ),
        "score": obj(
            {
                "type": {"const": "score"},
                **head,
                **blink_features(choice=False),
                "criteria": {"type": "array", "minItems": 2, "maxItems": blink.MAX_LEVELS, "items": text_like()},
            },
            ("type", "criteria"),
        ),
    }
    model = served_model(models)
    asset = obj(
        {
            "type": {"enum": ["image", None]},
            "format": {"enum": ["png", "jpg", "jpeg", None]},
            "data_base64": {"type": ["string", "null"]},
            "part": {"type": ["string", "null"], "description": "a multipart part holding the image"},
        }
    )
    assets = {
        "type": ["object", "null"],
        "minProperties": 1,
        "propertyNames": {"minLength": 1, "description": "the placeholder that stands for the image in the texts"},
        "additionalProperties": ref("SystemOneAsset"),
    }
    shared = {
        "questions": question_names(
            {
                "type": "object",
                "minProperties": 1,
                "maxProperties": blink.MAX_QUESTIONS,
                "additionalProperties": ref("SystemOneQuestion"),
            }
        ),
        "assets": assets if images else {"type": "null", "description": "no served model reads images"},
    }
    answers = {
        "noul": obj({"type": {"const": "noul"}, "noul": probability()}, ("type", "noul"), closed=True),
        "choice": obj(
            {
                "type": {"const": "choice"},
                "choice": {"type": "string"},
                "confidence": probability(),
                "probabilities": {"type": "object", "additionalProperties": probability()},
            },
            ("type", "choice", "confidence", "probabilities"),
            closed=True,
        ),
        "score": obj(
            {
                "type": {"const": "score"},
                "score": {"type": "number", "minimum": 0, "maximum": blink.MAX_LEVELS - 1},
                "confidence": probability(),
                "legend": {"type": "object", "additionalProperties": text_like()},
                "probabilities": {"type": "object", "additionalProperties": probability()},
            },
            ("type", "score", "confidence", "legend", "probabilities"),
            closed=True,
        ),
    }
    response = obj(
        {
            "model": {"type": "string"},
            "answers": {"type": "object", "additionalProperties": ref("SystemOneAnswer")},
            "usage": obj(
                {"input_tokens": {"type": "integer", "minimum": 0}, "output_tokens": {"const": 0}},
                ("input_tokens", "output_tokens"),
            ),
            "x_meta": {"type": "object", "description": "blink's additions: the engine's meta, and per question"},
        },
        ("model", "answers", "usage"),
    )
    return {
        **{f"SystemOne{kind.title()}Question": schema for kind, schema in questions.items()},
        "SystemOneQuestion": {
            "oneOf": [ref(f"SystemOne{kind.title()}Question") for kind in questions],
            "discriminator": {
                "propertyName": "type",
                "mapping": {kind: ref(f"SystemOne{kind.title()}Question")["$ref"] for kind in questions},
            },
        },
        "SystemOneAsset": asset,
        "SystemOneRequest": obj({"model": model, "state": evidence(), **shared}, ("model", "state", "questions")),
        "SystemOneBatchRequest": obj(
            {
                "model": {**model, "default": wire.DEFAULT_MODEL_ALIAS},
                "states": {"type": "array", "minItems": 1, "maxItems": wire.MAX_BATCH_STATES, "items": evidence()},
                **shared,
            },
            ("states", "questions"),
        ),
        **{f"SystemOne{kind.title()}Answer": schema for kind, schema in answers.items()},
        "SystemOneAnswer": {"oneOf": [ref(f"SystemOne{kind.title()}Answer") for kind in answers]},
        "SystemOneResponse": response,
        "SystemOneBatchResponse": obj(
            {"results": {"type": "array", "items": ref("SystemOneResponse"), "maxItems": wire.MAX_BATCH_STATES}},
            ("results",),
            closed=True,
        ),
        "ModelList": obj(
            {
                "models": {
                    "type": "array",
                    "items": obj(
                        {
                            "name": {"type": "string"},
                            "description": {"type": "string"},
                            "release_date": {"type": "string"},
                        },
                        ("name", "description", "release_date"),
                    ),
                }
            },
            ("models",),
        ),
        "ValidationError": obj(
            {
                "detail": {
                    "type": "array",
                    "items": obj(
                        {
                            "loc": {"type": "array", "items": {"type": ["string", "integer"]}},
                            "msg": {"type": "string"},
                            "type": {"type": "string"},
                        },
                        ("loc", "msg", "type"),
                    ),
                }
            },
            ("detail",),
        ),
        "Error": obj(
            {
                "detail": obj(
                    {"error_type": {"type": "string"}, "message": {"type": "string"}}, ("error_type", "message")
                )
            },
            ("detail",),
        ),
    }


NOT_BLANK_MESSAGE = {
    "not": {
        "minItems": 1,
        "maxItems": 1,
        "items": {
            "properties": {
                "role": {"const": "user"},
                "content": {
                    "anyOf": [
                        blank(),
                        {
                            "type": "array",
                            "items": {
                                "properties": {"type": {"const": "input_text"}, "text": blank()},
                                "required": ["type", "text"],
                            },
                        },
                    ]
                },
            },
            "required": ["role", "content"],
        },
    }
}  # an input of one user message holding only blank text is blank evidence, which blink refuses


def decisions_schemas(models: list[str], images: bool) -> dict:
    """OpenAI Decisions' request, answers, reply and error; images: a served model reads them (else no part is an
    image)."""
    parts = {
        "input_text": obj({"type": {"const": "input_text"}, "text": {"type": "string"}}, ("type", "text")),
        "output_text": obj({"type": {"const": "output_text"}, "text": {"type": "string"}}, ("type", "text")),
        "refusal": obj({"type": {"const": "refusal"}, "refusal": {"type": "string"}}, ("type", "refusal")),
        "input_image": obj(
            {"type": {"const": "input_image"}, "image_url": {"type": "string", "pattern": "^data:image/"}},
            ("type", "image_url"),
        ),
        "input_json": obj({"type": {"const": "input_json"}, "data": {"type": ["object", "array"]}}, ("type", "data")),
    }
    if not images:
        del parts["input_image"]
    message = {
        "oneOf": [
            obj(
                {
                    "role": {"const": role},
                    "content": {
                        "oneOf": [
                            {"type": "string"},
                            {"type": "array", "items": {"oneOf": [parts[p] for p in allowed if p in parts]}},
                        ]
                    },
                },
                ("role", "content"),
            )
            for role, allowed in wire.DECISION_PARTS.items()
        ]
    }
    item = {"oneOf": [message, obj({"type": {"enum": list(wire.DECISION_ITEMS)}}, ("type",))]}
    instructions = {
        "oneOf": [
            {"type": "string"},
            {"type": "array", "items": {"oneOf": [parts[p] for p in ("input_text", "input_image") if p in parts]}},
        ]
    }
    head = {"name": {"type": ["string", "null"]}, "instructions": instructions}
    questions = {
        "predicate": obj(
            {"type": {"const": "predicate"}, **head, **blink_features(choice=False)}, ("type", "instructions")
        ),
        "choice": obj(
            {
                "type": {"const": "choice"},
                **head,
                **blink_features(choice=True),
                "choices": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": blink.MAX_OPTIONS,
                    "items": obj(
                        {"value": {"type": ["string", "boolean"]}, "description": {"type": ["string", "null"]}},
                        ("value",),
                    ),
                    "uniqueItems": True,
                    "description": "each value once (true and 'true' are one value)",
                },
            },
            ("type", "instructions", "choices"),
            **NOT_MULTI_AND_PERMUTE,
        ),
        "score": obj(
            {
                "type": {"const": "score"},
                **head,
                **blink_features(choice=False),
                "levels": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": blink.MAX_LEVELS,
                    "items": obj(
                        {"label": {"type": "string"}, "description": {"type": ["string", "null"]}}, ("label",)
                    ),
                },
            },
            ("type", "instructions", "levels"),
        ),
    }
    name = {"type": ["string", "null"]}
    answers = {
        "predicate": obj({"type": {"const": "predicate"}, "name": name, "probability": probability()}, closed=True),
        "choice": obj(
            {
                "type": {"const": "choice"},
                "name": name,
                "choice": {"type": ["string", "boolean"]},
                "confidence": probability(),
                "probabilities": {
                    "type": "array",
                    "items": obj({"value": {"type": ["string", "boolean"]}, "probability": probability()}, closed=True),
                },
            },
            closed=True,
        ),
        "score": obj(
            {
                "type": {"const": "score"},
                "name": name,
                "score": {"type": "number", "minimum": 0, "maximum": blink.MAX_LEVELS - 1},
                "confidence": probability(),
                "probabilities": {
                    "type": "array",
                    "items": obj(
                        {"value": {"type": "integer"}, "label": {"type": "string"}, "probability": probability()},
                        closed=True,
                    ),
                },
            },
            closed=True,
        ),
    }
    count = {"type": "integer", "minimum": 0}
    return {
        **{f"Decisions{kind.title()}Question": schema for kind, schema in questions.items()},
        "DecisionsRequest": obj(
            {
                "model": served_model(models),
                "input": {"oneOf": [non_blank(), {"type": "array", "minItems": 1, "items": item, **NOT_BLANK_MESSAGE}]},
                "questions": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": blink.MAX_QUESTIONS,
                    "items": {"oneOf": [ref(f"Decisions{kind.title()}Question") for kind in questions]},
                },
            },
            ("model", "input", "questions"),
        ),
        "DecisionsResponse": obj(
            {
                "model": {"type": "string"},
                "answers": {"type": "array", "items": {"oneOf": list(answers.values())}},
                "usage": obj(
                    {
                        "input_tokens": count,
                        "input_tokens_details": {"type": "object"},
                        "output_tokens": {"const": 0},
                        "output_tokens_details": {"type": "object"},
                        "total_tokens": count,
                    },
                    ("input_tokens", "output_tokens", "total_tokens"),
                ),
                "x_meta": {"type": "object"},
            },
            ("model", "answers", "usage"),
        ),
        "DecisionsError": obj(
            {
                "error": obj(
                    {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": {"type": ["string", "null"]},
                        "code": {"type": ["string", "null"]},
                    },
                    ("message", "type"),
                )
            },
            ("error",),
        ),
    }


def json_body(schema: str) -> dict:
    """A JSON request or reply body of one component schema."""
    return {"application/json": {"schema": ref(schema)}}


def systemone_body(schema: str, images: bool) -> dict:
    """A System One body: the JSON request, or a multipart form of the JSON request in its `request` part and, when
    a served model reads images, the image parts its assets name."""
    parts = {"type": "string", "format": "binary", "description": "an image an asset names"} if images else False
    form = {
        "schema": {
            "type": "object",
            "properties": {"request": ref(schema)},
            "required": ["request"],
            "additionalProperties": parts,
        },
        "encoding": {"request": {"contentType": "application/json"}},
    }
    return {**json_body(schema), "multipart/form-data": form}


def replies(ok: str, error: str, validation: str | None, statuses: tuple) -> dict:
    """A route's replies: 200 with `ok`, 422 with `validation` (when the protocol has field-level errors apart), every
    other refusal with `error`."""
    out = {"200": {"description": "answered", "content": json_body(ok)}}
    for status in statuses:
        schema = validation if status == 422 and validation else error
        out[str(status)] = {"description": REFUSALS[status], "content": json_body(schema)}
    return out


REFUSALS = {
    400: "a malformed body (a multipart form without its request part, an unsupported question type)",
    401: "a missing or wrong API key (BLINK_API_KEY)",
    404: "a model that is not served",
    413: "a body over BLINK_MAX_BODY_BYTES",
    415: "a content type or encoding other than JSON, multipart or zstd",
    422: "a field that cannot be answered, named in the reply",
    500: "a failure inside the model (its type only)",
    503: "busy: retry after Retry-After seconds",
}
DECIDING = (400, 401, 404, 413, 415, 422, 500, 503)


def document(deployment: blink.Deployment, keyed: bool) -> dict:
    """The OpenAPI document of the /v1 routes of a deployment; keyed: BLINK_API_KEY is set (the bearer scheme is then
    required, else any Authorization header is accepted)."""
    security = [{"bearer": []}] if keyed else [{"bearer": []}, {}]
    models = deployment.models()
    images = any(deployment.engine(mid).reads_images for mid in models)
    paths = {
        "/v1/systemone": {
            "post": {
                "operationId": "systemOne",
                "summary": "TypeSafe's System One: one state, typed questions, one answer each",
                "security": security,
                "requestBody": {"required": True, "content": systemone_body("SystemOneRequest", images)},
                "responses": replies("SystemOneResponse", "Error", "ValidationError", DECIDING),
            }
        },
        "/v1/systemone/batch": {
            "post": {
                "operationId": "systemOneBatch",
                "summary": (
                    f"laya-serve's batch: one question set asked of 1 to {wire.MAX_BATCH_STATES} states; a result per "
                    "state, each answered as the state would be alone"
                ),
                "security": security,
                "requestBody": {"required": True, "content": systemone_body("SystemOneBatchRequest", images)},
                "responses": replies("SystemOneBatchResponse", "Error", "ValidationError", DECIDING),
            }
        },
        "/v1/decisions": {
            "post": {
                "operationId": "createDecision",
                "summary": "OpenAI's Decisions: input and questions, answers in question order",
                "security": security,
                "requestBody": {"required": True, "content": json_body("DecisionsRequest")},
                "responses": replies("DecisionsResponse", "DecisionsError", None, DECIDING),
            }
        },
        "/v1/models": {
            "get": {
                "operationId": "listModels",
                "summary": "the served models and the default model's alias",
                "security": security,
                "responses": replies("ModelList", "Error", None, (401,)),
            }
        },
    }
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "blink", "version": "1", "description": "one-pass typed decisions from a language model"},
        "paths": paths,
        "components": {
            "schemas": {**systemone_schemas(models, images), **decisions_schemas(models, images)},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
