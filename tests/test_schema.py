"""Request validation and the exact template text the model was trained on."""

from __future__ import annotations

import pytest

import blink

SYSTEM_TEXT = (
    "Apply the supplied criterion to the supplied evidence. Choose exactly one listed option. "
    "Respond with only its uppercase letter, with no explanation or reasoning."
)


def render_user(state, q: dict) -> str:
    """The user turn blink renders for one question."""
    (row,) = blink.parse_question("q", q).rows
    return blink.user_message(state, row, blink.LABEL_POOL[: len(row.shown)])


def test_system_prompt_and_label_pool_are_the_trained_ones():
    assert blink.SYSTEM == SYSTEM_TEXT
    assert blink.LABEL_POOL[:3] == ["A", "B", "C"] and blink.LABEL_POOL[25] == "Z"
    assert blink.LABEL_POOL[26:29] == ["AA", "AB", "AC"] and blink.LABEL_POOL[-1] == "ZZ"
    assert len(blink.LABEL_POOL) == 26 + 26 * 26


def test_golden_choice_with_described_options():
    q = {
        "type": "choice",
        "instructions": "  Route the ticket. ",
        "criteria": {"refund": "Customer wants money back", "A": "Billing question", "bug": "Bug", "other": ""},
    }
    assert render_user("Où est mon remboursement?", q) == (
        '{"evidence": "Où est mon remboursement?", "criterion": "Route the ticket.", "options": ['
        '{"letter": "A", "description": "refund: Customer wants money back"}, '
        '{"letter": "B", "description": "Billing question"}, '
        '{"letter": "C", "description": "Bug"}, '
        '{"letter": "D", "description": "other"}]}'
    )


def test_golden_choice_list_and_json_state():
    q = {"type": "choice", "instructions": "Which plan?", "criteria": ["free", "pro", 3]}
    assert render_user({"user": {"seats": 12}, "tags": ["ü"]}, q) == (
        '{"evidence": {"user": {"seats": 12}, "tags": ["ü"]}, "criterion": "Which plan?", "options": ['
        '{"letter": "A", "description": "free"}, {"letter": "B", "description": "pro"}, '
        '{"letter": "C", "description": "3"}]}'
    )


def test_golden_noul_with_and_without_descriptions():
    described = {
        "type": "noul",
        "instructions": "Is it urgent?",
        "criteria": {"true": "needs action today", "no": "can wait"},
    }
    assert render_user("x", described) == (
        '{"evidence": "x", "criterion": "Is it urgent?", "options": ['
        '{"letter": "A", "description": "Yes — needs action today"}, '
        '{"letter": "B", "description": "No — can wait"}]}'
    )
    plain = {"type": "noul", "instructions": "Spam?"}
    assert render_user("x", plain).endswith(
        '"options": [{"letter": "A", "description": "Yes"}, {"letter": "B", "description": "No"}]}'
    )


def test_golden_score_levels():
    q = {"type": "score", "instructions": "Severity", "criteria": ["none", None, {"label": "high"}]}
    assert render_user("", q) == (
        '{"evidence": "", "criterion": "Severity", "options": ['
        '{"letter": "A", "description": "Level 0: none"}, {"letter": "B", "description": "Level 1"}, '
        '{"letter": "C", "description": "Level 2: {\\n  \\"label\\": \\"high\\"\\n}"}]}'
    )


def test_golden_full_prompt_with_chat_template(standin):
    q = {"type": "noul", "instructions": "Spam?"}
    user = render_user("Buy now", q)
    assert blink.wrap(standin.tok, user) == (
        f"<|im_start|>system\n{SYSTEM_TEXT}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )


def test_option_text_rules():
    assert blink.option_text("opt3", "Red") == "Red"
    assert blink.option_text("option_2", "Red") == "Red"
    assert blink.option_text("12", "Red") == "Red"
    assert blink.option_text("Red", "red ") == "red "
    assert blink.option_text("color", "Red") == "color: Red"
    assert blink.option_text("color", None) == "color"
    assert blink.option_text("color", {"rgb": [1, 2]}) == 'color: {\n  "rgb": [\n    1,\n    2\n  ]\n}'


def test_as_state_passes_json_through_and_keeps_text():
    assert blink.as_state(' {"a": 1}') == {"a": 1}
    assert blink.as_state("[1, 2]") == [1, 2]
    assert blink.as_state("{not json") == "{not json"
    assert blink.as_state("plain words") == "plain words"
    assert blink.as_state({"a": 1}) == {"a": 1}


@pytest.mark.parametrize(
    "questions, needle, loc",
    [
        (None, "questions must be a non-empty object", ["body", "questions"]),
        ({}, "questions must be a non-empty object", ["body", "questions"]),
        ([{"type": "noul"}], "questions must be a non-empty object", ["body", "questions"]),
        ({f"q{i}": {"type": "noul"} for i in range(513)}, "513 questions; supported 1-512", ["body", "questions"]),
        ({"q": "yes?"}, "question 'q' must be an object", ["body", "questions", "q"]),
        (
            {"q": {"type": "rank"}},
            "question 'q': type must be one of choice, noul, score",
            ["body", "questions", "q", "type"],
        ),
        ({"q": {}}, "question 'q': type must be one of", ["body", "questions", "q", "type"]),
        ({"q": {"type": ["noul"]}}, "question 'q': type must be one of", ["body", "questions", "q", "type"]),
        ({"q": {"type": {"noul": 1}}}, "question 'q': type must be one of", ["body", "questions", "q", "type"]),
        ({"q": {"type": "choice"}}, "question 'q': a choice needs criteria", ["body", "questions", "q", "criteria"]),
        (
            {"q": {"type": "choice", "criteria": "red"}},
            "a choice needs criteria",
            ["body", "questions", "q", "criteria"],
        ),
        (
            {"q": {"type": "choice", "criteria": []}},
            "question 'q': 0 options; supported 1-255",
            ["body", "questions", "q", "criteria"],
        ),
        (
            {"q": {"type": "choice", "criteria": [f"o{i}" for i in range(256)]}},
            "256 options; supported 1-255",
            ["body", "questions", "q", "criteria"],
        ),
        (
            {"q": {"type": "choice", "criteria": ["a", "a"]}},
            "duplicate option keys",
            ["body", "questions", "q", "criteria"],
        ),
        (
            {"q": {"type": "choice", "criteria": [1, "1"]}},
            "duplicate option keys",
            ["body", "questions", "q", "criteria"],
        ),
        (
            {"q": {"type": "choice", "criteria": [{"x": 1}]}},
            "criteria list items must be strings or numbers",
            ["body", "questions", "q", "criteria"],
        ),
        (
            {"q": {"type": "noul", "criteria": ["yes"]}},
            "noul criteria must be an object",
            ["body", "questions", "q", "criteria"],
        ),
        (
            {"q": {"type": "score", "criteria": ["only"]}},
            "a score takes a list of 2 to 10 levels",
            ["body", "questions", "q", "criteria"],
        ),
        (
            {"q": {"type": "score", "criteria": list(range(11))}},
            "2 to 10 levels",
            ["body", "questions", "q", "criteria"],
        ),
        (
            {"q": {"type": "score", "criteria": {"a": 1, "b": 2}}},
            "2 to 10 levels",
            ["body", "questions", "q", "criteria"],
        ),
        (
            {"q": {"type": "noul", "instructions": True}},
            "question 'q': instructions must be text",
            ["body", "questions", "q", "instructions"],
        ),
        (
            {"q": {"type": "noul", "instructions": 3}},
            "instructions must be text",
            ["body", "questions", "q", "instructions"],
        ),
        ({"": {"type": "noul"}}, "question names must be non-empty strings", ["body", "questions"]),
        ({1: {"type": "noul"}}, "question names must be non-empty strings", ["body", "questions"]),
    ],
)
def test_every_bad_request_names_the_question_and_field(questions, needle, loc):
    with pytest.raises(blink.BlinkError) as caught:
        blink.parse_questions(questions)
    assert needle in str(caught.value)
    assert caught.value.loc == loc


def test_bounds_that_are_allowed():
    assert len(blink.parse_questions({"q": {"type": "choice", "criteria": ["only"]}})[0].options) == 1
    widest = blink.parse_questions({"q": {"type": "choice", "criteria": [f"o{i}" for i in range(255)]}})
    assert len(widest[0].options) == 255
    assert len(blink.parse_questions({f"q{i}": {"type": "noul"} for i in range(512)})) == 512
    assert len(blink.parse_questions({"q": {"type": "score", "criteria": list(range(10))}})[0].options) == 10


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), "hot", None, [1]])
def test_bad_temperatures_are_refused(value):
    with pytest.raises(blink.BlinkError, match="temperature"):
        blink.check_temperature(value)


def test_request_key_is_the_recordings_key():
    qs = {"a": {"type": "noul"}}
    assert blink.request_key("x\r\ny ", qs) == blink.request_key("x\ny", qs)
    assert blink.request_key("x", qs) != blink.request_key("x", {"a": {"type": "noul", "instructions": ""}})
    reordered = {"b": {"type": "noul"}, "a": {"type": "noul"}}
    assert blink.request_key("x", {"a": {"type": "noul"}, "b": {"type": "noul"}}) != blink.request_key("x", reordered)
    # the layout is the reference design's, which recordings depend on: sha256 of compact, non-ASCII-preserving JSON,
    # first 32 hex digits
    import hashlib

    blob = '{"state":"é","questions":{"a":{"type":"noul"}}}'
    assert blink.request_key(" é ", qs) == hashlib.sha256(blob.encode()).hexdigest()[:32]
