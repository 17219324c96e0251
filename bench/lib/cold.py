"""One request over a log the engine has not seen, timed cold (drift, gpu, shape4b), and the eight questions drift
asks of a ticket log."""

from __future__ import annotations

from dataclasses import dataclass

import blink
from bench.lib import answers, harness, workloads

WARM = ("The parcel arrived on time.", {"q": {"type": "noul", "instructions": "Did the parcel arrive?"}})


def questions(n_tickets: int) -> dict:
    """Eight questions about a ticket log, every type: six choices of four teams, a yes/no and a 5-level score."""
    qs = workloads.questions(6, 4, n_tickets)
    last = max(1, n_tickets)
    qs["refund"] = {"type": "noul", "instructions": f"Did the customer in ticket #{last} ask for a refund?"}
    qs["upset"] = {
        "type": "score",
        "instructions": f"How upset is the customer in ticket #{last}?",
        "criteria": ["calm", "mildly annoyed", "frustrated", "angry", "furious"],
    }
    return qs


def evidence_tokens(prompt: blink.Prompt) -> int:
    """How many of a rendered prompt's tokens are the evidence (between its first and last cut; all of it when the
    prompt has no cuts)."""
    return prompt.cuts[-1] - prompt.cuts[0] if prompt.cuts else len(prompt.ids)


@dataclass
class Cold:
    """One request over a log the engine had not seen: its wall and CPU seconds, its answers at temperature 1, and on
    a GPU the memory it took beyond what was held before it (torch's allocator)."""

    wall_s: float
    cpu_s: float
    answers: dict
    working_mb: float | None = None


def cold_run(engine: blink.TorchEngine, request: blink.Request, warm: blink.Request) -> Cold:
    """The request over a log the engine has not seen: its kept prefixes dropped, then the template header kept by
    a short request, as after any other request. On a GPU the wall time waits for the device."""
    engine.prefixes.clear()
    engine.forward(warm)
    device = engine.model.lm_head.weight.device

    def forward() -> blink.Forward:
        result = engine.forward(request)
        harness.sync(device)
        return result

    if device.type != "cuda":
        wall, cpu, result = harness.timed(forward)
        return Cold(wall, cpu, answers.of(request, result.readouts))
    from bench.lib import grid  # torch: imported where a GPU is timed

    with grid.PeakMemory(device) as memory:
        wall, cpu, result = harness.timed(forward)
    return Cold(wall, cpu, answers.of(request, result.readouts), memory.peak_mb)
