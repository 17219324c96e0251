"""blink at blink-4b's size on a CPU: seconds per request and resident memory, bfloat16 against BLINK_QUANTIZE=int8.

    python -m bench shape4b --threads 2     # writes bench/results/shape4b.json
    python -m bench shape4b --quick         # the short question only

The model is a random-weight Qwen3.5 text model at the 4.2 B-parameter shape `python -m bench gpu` builds
(checkpoints.SHAPE: Qwen3.5-4B's hybrid of linear- and full-attention layers, its 248,320-entry vocabulary), with the
tiny test tokenizer, built here once in bfloat16 and kept under BLINK_CACHE (shape4b/, about 8 GB). Random weights say
nothing of answers: this is for time and memory only. Each arm runs in a child process of its own, so that its resident
memory is its own: blink's torch engine loaded by blink's real loading code at its defaults but for the arm's setting
(bfloat16, or BLINK_QUANTIZE=int8), then one short yes/no question and one ~3,400-token ticket log with 8 questions,
each run cold (kept prefixes dropped) `--reps` times. Resident memory is the child's VmRSS after the runs and its peak
(VmHWM), loading included."""

from __future__ import annotations

import os
import statistics
from dataclasses import replace

import blink
from bench.lib import checkpoints, cold, harness, report, workloads
from bench.workers import isolated

CONFIGS = {"full": {"doc_tokens": 3400, "reps": 2}, "quick": {"doc_tokens": 0, "reps": 1}}
ARMS = {"bfloat16": {"dtype": "bfloat16"}, "int8": {"quantize": "int8"}}
SHORT = (
    "The parcel arrived two days late and the box was dented.",
    {"late": {"type": "noul", "instructions": "Was it late?"}},
)


def model_folder(cache_dir: str) -> str:
    """The random-weight Qwen3.5 of checkpoints.SHAPE in bfloat16 under cache_dir (built once: about 8 GB on disk)."""
    import torch

    folder = os.path.join(cache_dir, "shape4b", "qwen3.5-4b-shape")
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    partial = f"{folder}.partial-{os.getpid()}"
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bfloat16 from the start: 8 GB, not float32's 17
    try:
        checkpoints.qwen_4b(partial, "cpu")
    finally:
        torch.set_default_dtype(before)
    os.replace(partial, folder)
    return folder


def memory_mb() -> dict:
    """This process's resident memory now and at its peak (MB, /proc/self/status)."""
    with open("/proc/self/status", encoding="utf-8") as fh:
        fields = dict(line.split(":", 1) for line in fh if line.startswith(("VmRSS", "VmHWM")))
    return {"rss_mb": int(fields["VmRSS"].split()[0]) // 1024, "peak_rss_mb": int(fields["VmHWM"].split()[0]) // 1024}


def tensor_bytes(values) -> int:
    """The bytes of the tensors in a state dict's values (a quantized layer's packed weights are a tuple of them)."""
    import torch

    total = 0
    for value in values:
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, tuple):
            total += tensor_bytes(value)
    return total


def arm_run(folder: str, settings: dict, threads: int, doc_tokens: int, reps: int) -> dict:
    """One arm, in the child process it runs in: blink's engine loaded, then each case cold `reps` times."""
    import torch

    torch.set_num_threads(threads)
    watch = harness.Stopwatch()
    engine = blink.TorchEngine(folder, settings=replace(blink.Settings.from_env({}), **settings))
    out = {"load_s": round(watch.seconds(), 2), "loaded": memory_mb(), "cases": {}}
    warm = blink.parse_request(*cold.WARM, settings=engine.settings)
    cases = {"short": SHORT}
    if doc_tokens:
        doc = workloads.document(engine.tok, doc_tokens, seed=7)
        cases["document"] = (doc, cold.questions(workloads.ticket_count(doc)))
    for case, (state, questions) in cases.items():
        request = blink.parse_request(state, questions, settings=engine.settings)
        runs = [cold.cold_run(engine, request, warm) for _ in range(reps)]
        out["cases"][case] = {
            "prompt_tokens": sum(len(p.ids) for p in engine.render(request)),
            "wall_s": [round(r.wall_s, 3) for r in runs],
            "median_wall_s": round(statistics.median(r.wall_s for r in runs), 3),
        }
        print(f"  {case}: {out['cases'][case]['wall_s']} s", flush=True)
    out["after"] = memory_mb()
    out["weights_mb"] = round(tensor_bytes(engine.model.state_dict().values()) / 2**20)
    return out


def main(argv: list[str] | None = None) -> int:
    """Measure each arm in a child process, write JSON, print one summary line last."""
    run = harness.Run("shape4b", argv, __doc__, threads="2")
    cfg = CONFIGS["quick" if run.quick else "full"]
    threads = run.threads
    folder = model_folder(blink.Settings.from_env({}).cache_dir)
    run.probe()
    rows = {}
    for name, settings in ARMS.items():
        print(f"{name}: loading in a child process", flush=True)
        child = isolated.Child("blink", arm_run, folder, settings, threads, cfg["doc_tokens"], cfg["reps"])
        rows[name] = child.call("copy")
        child.close()
    ratios = {
        case: round(rows["int8"]["cases"][case]["median_wall_s"] / rows["bfloat16"]["cases"][case]["median_wall_s"], 2)
        for case in rows["bfloat16"]["cases"]
    }
    res = {
        "model": {"kind": "random-weight Qwen3.5 text model", **checkpoints.SHAPE},
        "arms": rows,
        "int8_time_ratio": ratios,
    }
    path = run.write(res)
    print(
        f"4.2 B Qwen3.5 shape on {blink.hardware()}, {threads} threads: int8/bfloat16 time "
        + ", ".join(f"{case} {r}x" for case, r in ratios.items())
        + f"; peak resident bfloat16 {rows['bfloat16']['after']['peak_rss_mb'] / 1024:.1f} GB, int8 "
        f"{rows['int8']['after']['peak_rss_mb'] / 1024:.1f} GB; results {os.path.relpath(path)}"
    )
    return 0


def shape4b_table(res: dict) -> list[str]:
    """bench/shape4b.py: each arm's seconds per case and its resident memory (GB of 2^30 bytes, VmRSS and VmHWM)."""
    cases = next(iter(res["arms"].values()))["cases"]
    head = ["arm", "load s", *(f"{c} s ({got['prompt_tokens']} tokens)" for c, got in cases.items())]
    head += ["resident after load", "resident after the runs", "peak resident (load included)", "weights"]
    gb = lambda mb: f"{mb / 1024:.1f} GB"  # noqa: E731
    rows = [
        [name, r["load_s"], *(", ".join(f"{w:.2f}" for w in r["cases"][c]["wall_s"]) for c in cases)]
        + [gb(r["loaded"]["rss_mb"]), gb(r["after"]["rss_mb"]), gb(r["after"]["peak_rss_mb"]), gb(r["weights_mb"])]
        for name, r in res["arms"].items()
    ]
    ratios = ", ".join(f"{c} {v}x" for c, v in res["int8_time_ratio"].items())
    return report.table(head, rows) + ["", f"int8 over bfloat16, median time: {ratios}"]


REPORT = (shape4b_table, ("arms", "int8_time_ratio", "model"))
