"""Property-based bad input: every case ends in a clear BlinkError naming the field, or a valid answer."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blink

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULTS = blink.Settings()  # every setting at its default, on a machine without a GPU
# Text that stresses rendering: expands on lowercasing (İ, ß), combining marks, RTL, astral, NUL, data-URI lookalikes.
TRICKY = st.sampled_from(
    [
        "İstanbul",
        "Straße",
        "ﬁ",
        "e\u0301",
        "مرحبا",
        "😀",
        "\x00",
        "",
        " ",
        "\r\n",
        "data:image/png;base64,",
        "DATA:IMAGE/PNG ;BASE64,AAAA",
        "{",
        "[1,",
        "A",
        "ZZ",
    ]
)
TEXT = st.one_of(st.text(max_size=40), TRICKY)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True), TEXT)
JSONISH = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=12,
)
CRITERIA = st.one_of(
    JSONISH,
    st.lists(TEXT, min_size=0, max_size=12),
    st.dictionaries(TEXT, st.one_of(TEXT, st.none()), max_size=8),
    st.integers(0, 300).map(lambda n: [f"o{i}" for i in range(n)]),  # 0 and 256 options among them
)


def plausible(text: st.SearchStrategy, json_values: st.SearchStrategy, levels: tuple[int, int] = (2, 10)):
    """Questions that look right (choice, noul, score), with tricky text in every field; `levels` bounds a score's."""
    return st.one_of(
        st.fixed_dictionaries(
            {
                "type": st.just("choice"),
                "criteria": st.one_of(
                    st.lists(text, min_size=1, max_size=8, unique=True),
                    st.dictionaries(text, text, min_size=1, max_size=6),
                ),
            },
            optional={"instructions": text},
        ),
        st.fixed_dictionaries(
            {"type": st.just("noul")},
            optional={
                "instructions": text,
                "criteria": st.one_of(st.none(), st.fixed_dictionaries({}, optional={"true": text, "no": json_values})),
            },
        ),
        st.fixed_dictionaries(
            {
                "type": st.just("score"),
                "criteria": st.lists(st.one_of(text, st.none()), min_size=levels[0], max_size=levels[1]),
            },
            optional={"instructions": text},
        ),
    )


PLAUSIBLE = plausible(TEXT, JSONISH)
QUESTION = st.one_of(
    PLAUSIBLE,
    PLAUSIBLE,
    JSONISH,
    st.fixed_dictionaries(
        {"type": st.sampled_from(["choice", "noul", "score", "rank", None, 3])},
        optional={"criteria": CRITERIA, "instructions": st.one_of(TEXT, JSONISH)},
    ),
)
NAME = st.one_of(st.text(min_size=1, max_size=20), TRICKY)
QUESTIONS = st.one_of(
    st.dictionaries(NAME, PLAUSIBLE, min_size=1, max_size=5),
    st.dictionaries(NAME, QUESTION, min_size=1, max_size=5),
    JSONISH,
    st.integers(510, 515).map(lambda n: {f"q{i}": {"type": "noul"} for i in range(n)}),  # 513 among them
)
TEMPERATURE = st.one_of(
    st.none(),
    st.floats(0.05, 5.0),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-2, 3),
    TEXT,
    st.sampled_from([5e-324, 1e-310, 1.7e308, 10**400, True, "inf", "1e-320"]),
)  # edges
STATE = st.one_of(JSONISH, TEXT, st.text(min_size=1000, max_size=3000))


def check_answer(out: dict, questions: dict) -> None:
    """A valid answer: one per question, probabilities over exactly the offered keys, summing to one."""
    assert set(out["answers"]) == set(questions)
    for qkey, q in questions.items():
        answer = out["answers"][qkey]
        keys = blink.parse_question(qkey, q).keys
        assert list(answer["probabilities"]) == keys
        assert math.isclose(sum(answer["probabilities"].values()), 1.0, rel_tol=1e-9)
    assert out["meta"]["generated_tokens"] == 0


def check_error(exc: Exception) -> None:
    """A clear refusal: a BlinkError with a message and a location in the request body."""
    assert isinstance(exc, blink.BlinkError), f"{type(exc).__name__}: {exc}"
    assert str(exc).strip() and "Traceback" not in str(exc)
    assert isinstance(exc.loc, list) and exc.loc[:1] == ["body"], exc.loc


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state=STATE, questions=QUESTIONS, temperature=TEMPERATURE)
def test_decide_on_arbitrary_input(mock_served, state, questions, temperature):
    try:
        out = mock_served.decide(state, questions, temperature=temperature)
    except Exception as exc:  # noqa: BLE001 - the property is about what escapes
        check_error(exc)
        return
    check_answer(out, questions)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.one_of(st.tuples(STATE, QUESTIONS), JSONISH), max_size=5))
def test_decide_many_on_arbitrary_input(mock_served, requests):
    try:
        out = mock_served.decide_many(requests)
    except Exception as exc:  # noqa: BLE001
        check_error(exc)
        return
    assert len(out) == len(requests)
    for req, res in zip(requests, out):
        if isinstance(res, Exception):
            check_error(res)
        else:
            check_answer(res, req[1])


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(state=STATE, questions=QUESTIONS)
def test_real_tokenizer_renders_or_refuses(standin, state, questions):
    try:
        prompts = standin.render(blink.parse_request(state, questions, settings=DEFAULTS))
    except Exception as exc:  # noqa: BLE001
        check_error(exc)
        return
    assert [p.qkey for p in prompts] == list(questions)
    for p in prompts:
        assert p.ids and len(p.cand) == len(blink.parse_question(p.qkey, questions[p.qkey]).options)


CLI_CASES = [
    ("x", "[]"),
    ("x", '{"q": {"type": "choice", "criteria": []}}'),
    ("x", "{" * 5000),
    ("İ" * 50, '{"q": {"type": "score", "criteria": ' + json.dumps(list(range(11))) + "}}"),
    ("{}", json.dumps({f"q{i}": {"type": "noul"} for i in range(513)})),
    ("x", '{"q": {"type": "noul"}}'),
]


def test_cli_never_prints_a_traceback(tmp_path):
    for state, questions in CLI_CASES:
        done = subprocess.run(
            [
                sys.executable,
                os.path.join(ROOT, "blink.py"),
                "--state",
                state,
                "--questions",
                questions,
                "--temperature",
                "0.7",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "BLINK_MOCK": "1"},
        )
        assert "Traceback" not in done.stderr, done.stderr
        if done.returncode == 0:
            check_answer(json.loads(done.stdout), json.loads(questions))
        else:
            assert done.returncode == 2 and done.stderr.startswith("error: ")
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "blink.py"),
            "--state",
            "x",
            "--questions",
            '{"q": {"type": "noul"}}',
            "--temperature",
            "nan",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "BLINK_MOCK": "1"},
    )
    assert done.returncode == 2 and "temperature must be a finite number above 0" in done.stderr
