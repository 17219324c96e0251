"""schemathesis hooks for tests/test_openapi_fuzz.py (loaded by name through SCHEMATHESIS_HOOKS): generated bodies
that break a rule /openapi.json states in words because JSON Schema cannot compare two fields are dropped before they
are sent. The rules: a choice question's `permute` is at most its number of options, and a Decisions choice offers
each value once (true and "true" are one value)."""

from __future__ import annotations

import json

import schemathesis


def option_count(question: dict) -> int | None:
    """How many options a choice question offers (System One's criteria, Decisions' choices); None when not a list
    or an object."""
    options = question.get("criteria", question.get("choices"))
    return len(options) if isinstance(options, (dict, list)) else None


def permute_fits(question: dict) -> bool:
    """A question's permute is absent, not a number (a schema violation of its own), or at most its options."""
    n, count = question.get("permute"), option_count(question)
    return not isinstance(n, (int, float)) or isinstance(n, bool) or count is None or n <= count


def values_unique(question: dict) -> bool:
    """A Decisions choice question offers each value once, a boolean counted as its JSON text."""
    choices = question.get("choices")
    if not isinstance(choices, list):
        return True
    keys = [
        json.dumps(c["value"]) if isinstance(c["value"], bool) else c["value"]
        for c in choices
        if isinstance(c, dict) and isinstance(c.get("value"), (str, bool))
    ]
    return len(keys) == len(set(keys))


def questions_of(body) -> list:
    """The questions of a JSON or multipart request body (System One's object values, Decisions' list)."""
    request = body.get("request", body) if isinstance(body, dict) else None
    questions = request.get("questions") if isinstance(request, dict) else None
    if isinstance(questions, dict):
        questions = list(questions.values())
    return [q for q in questions if isinstance(q, dict)] if isinstance(questions, list) else []


def keeps_cross_field_rules(body) -> bool:
    """True unless a question breaks a rule that relates two of its fields."""
    return all(permute_fits(q) and values_unique(q) for q in questions_of(body))


@schemathesis.hook
def filter_body(context, body) -> bool:
    """Send only bodies that keep the document's cross-field rules."""
    return keeps_cross_field_rules(body)
