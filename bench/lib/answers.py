"""The one answer comparison of bench/: any arm's answers (blink's own shapes, System One's, a peer's) read as a
distribution and a pick, and compared question by question with a reference's."""

from __future__ import annotations

import blink


def of(request: blink.Request, readouts: dict[str, blink.Readout], temperature: float = 1.0) -> dict:
    """A request's answers, as blink gives them, from its questions' readouts at one temperature."""
    return blink.assemble(request, readouts, {q.key: temperature for q in request.questions})


def distribution(answer: dict) -> dict[str, float]:
    """An answer's probability per option, in the order the request lists them (a System One yes/no answer carries
    p(yes) alone: yes, then no)."""
    if "probabilities" in answer:
        return answer["probabilities"]
    return {"yes": answer["noul"], "no": 1.0 - answer["noul"]}


def pick(answer: dict) -> str:
    """The option an answer chose: its `choice`, else its most probable option (ties go to the earlier, as blink
    breaks them)."""
    if answer.get("choice") is not None:
        return answer["choice"]
    probs = distribution(answer)
    return blink.top_key(list(probs), list(probs.values()))


def margin(probs: dict[str, float]) -> float:
    """How far the most probable option stands above the next one (1 for a single option)."""
    top = sorted(probs.values(), reverse=True)
    return top[0] - top[1] if len(top) > 1 else 1.0


def compare(reference: dict[str, dict], other: dict[str, dict]) -> dict:
    """Another arm's answers against the reference's, over the questions both answered: the largest probability
    difference, the questions whose pick differs, and on each of those how far the reference's top two options stood
    apart."""
    keys = [k for k in reference if k in other]
    gap, differ = 0.0, []
    for key in keys:
        mine, theirs = distribution(reference[key]), distribution(other[key])
        gap = max(gap, *(abs(p - theirs[option]) for option, p in mine.items()))
        if pick(reference[key]) != pick(other[key]):
            differ.append(key)
    return {
        "questions": len(keys),
        "max_prob_diff": gap,
        "picks_differ": differ,
        "reference_margins": {k: round(margin(distribution(reference[k])), 4) for k in differ},
    }


def flat(answers: list[dict]) -> dict[str, dict]:
    """Several requests' answers as one map, each question keyed "REQUEST/QUESTION" (request by its index)."""
    return {f"{i}/{key}": answer for i, each in enumerate(answers) for key, answer in each.items()}
