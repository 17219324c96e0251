"""blink on blink-4b's own architecture on a CPU, against llama.cpp on the same weights: seconds per case, tokens
computed, resident memory, and how far each arm's label distributions lie from blink's at its defaults.

    python -m bench shape4b                  # the 4.2 B shape (bench/results/shape4b.json)
    python -m bench shape4b --quick          # the small shape, a shorter log (shape4b-quick.json)
    python -m bench shape4b --shape 4b-8l --name shape4b-8l   # the 4b's first 8 layers (float32 fits in 8 GB)
    python -m bench shape4b --load-only --name shape4b-load    # the 4b loaded, bfloat16 and int8: memory only
    python -m bench shape4b --shape 4b-8l --interleave --reps 3 --arms ARMS --name shape4b-8l-interleaved

The model: a random-weight Qwen3.5 text model (bench/lib/qwen_gguf.py: Qwen3.5-4B's hybrid of Gated DeltaNet and full
attention layers, every fourth one full, its 248,320-row vocabulary; "small" keeps the proportions at 103 M
parameters) tokenized with the Qwen vocabulary llama.cpp ships for its qwen35 pre-tokenizer, and the same weights
converted to GGUF by llama.cpp's own converter (BF16) and quantizer (Q8_0). Random weights say nothing of answers: the
distributions compared show that the arms ran the same model on the same prompts; answer quality stays the
stand-in's and the tiny Qwen3.5's (`python -m bench drift`).

The arms, each in a child process of its own (so each one's resident memory is its own), one after another, or with
--interleave all loaded at once and each case asked of every arm in turn, so that every arm sees the same stretch of
the machine (memory for all the arms at once), on the same threads: blink at its defaults for this CPU (the dtype
rule's pick), blink in bfloat16 (only where the CPU computes bfloat16 natively: elsewhere its products fall back to a
slow path no user would pick), blink with BLINK_QUANTIZE=int8, blink with BLINK_QUANTIZE=w8a8-prefix (the evidence's
encode in 8-bit products), blink with transformers' own Gated DeltaNet code (BLINK_GATED_DELTA=transformers: what
blink's CPU path for those layers changes), and llama.cpp at BF16 and at Q8_0 (llama-cpp-python, reading blink's exact
prompt ids and the label logits at each prompt's last position; the state saved at blink's cut points and put back, as
llama-server's context checkpoints do, since llama.cpp cannot cut a Gated DeltaNet state back).

--load-only loads each blink arm in bfloat16 (blink_int8: int8 weights over bfloat16) and each llama.cpp arm, reads
their resident memory after loading and its peak, and asks nothing: what a CPU Space's memory must hold.

The cases, in order, each `--reps` times: one short yes/no question; a ticket log of about --doc-tokens tokens asked
eight questions, the engine's kept prefixes dropped first (a new document); the same log asked eight other
questions (the log kept from the case before). Before the first case every arm reads one warm-up question, so the
template header is kept as after any other request.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace

import blink
from bench.lib import answers, cold, harness, qwen_gguf, report, workloads
from bench.peers import llamacpp
from bench.workers import isolated

CONFIGS = {"full": {"shape": "4b", "doc_tokens": 3400, "reps": 1}, "quick": {"shape": "small", "doc_tokens": 600}}
BLINK_ARMS = {
    "blink": {},
    "blink_bfloat16": {"dtype": "bfloat16"},
    "blink_int8": {"quantize": "int8"},
    "blink_w8a8_prefix": {"quantize": "w8a8-prefix"},
    "blink_transformers_gdn": {"gated_delta": "transformers"},
}
LLAMA_ARMS = {"llama.cpp_bf16": "bf16", "llama.cpp_q8_0": "q8_0"}
SHORT = (
    "The parcel arrived two days late and the box was dented.",
    {"late": {"type": "noul", "instructions": "Was it late?"}},
)
CASES = ("short", "document", "again")  # "document" starts from nothing but the header; "again" keeps its log
KEPT_MARGIN = 0.1  # a pick must hold where the reference's top two labels stand further apart than this


def memory_mb(pid: int | str = "self") -> dict:
    """A process's resident memory now and at its peak (MB, /proc/PID/status)."""
    with open(f"/proc/{pid}/status", encoding="utf-8") as fh:
        fields = dict(line.split(":", 1) for line in fh if line.startswith(("VmRSS", "VmHWM")))
    return {"rss_mb": int(fields["VmRSS"].split()[0]) // 1024, "peak_rss_mb": int(fields["VmHWM"].split()[0]) // 1024}


def tensor_bytes(values) -> int:
    """The bytes of the tensors in a state dict's values (a quantized layer's packed weights are a tuple of them)."""
    import torch

    total = 0
    for value in values:
        if isinstance(value, torch.Tensor) and not value.is_mkldnn:
            total += value.numel() * value.element_size()
        elif isinstance(value, tuple):
            total += tensor_bytes(value)
    return total


def requests(tokenizer, doc_tokens: int) -> dict[str, tuple[str, dict]]:
    """Each case's (state, questions), and the warm-up question's."""
    doc = workloads.document(tokenizer, doc_tokens, seed=7)
    asked = cold.questions(workloads.ticket_count(doc))
    return {"warm": cold.WARM, "short": SHORT, "document": (doc, asked), "again": (doc, workloads.reworded(asked))}


class BlinkArm:
    """blink's torch engine at one arm's settings, in the child process it runs in: loaded by the real loading code,
    then asked the cases; it also hands out the prompts it rendered, for the llama.cpp arms to read."""

    def __init__(self, folder: str, settings: dict, threads: int, doc_tokens: int):
        import torch

        torch.set_num_threads(threads)
        watch = harness.Stopwatch()
        self.engine = blink.TorchEngine(folder, settings=replace(blink.Settings.from_env({}), **settings))
        self.load_s, self.loaded = round(watch.seconds(), 2), memory_mb()
        self.requests = {
            case: blink.parse_request(*body, settings=self.engine.settings)
            for case, body in requests(self.engine.tok, doc_tokens).items()
        }

    def describe(self) -> dict:
        """What was loaded: load time, memory, dtype, what runs its products and its linear-attention layers."""
        engine = self.engine
        return {
            "load_s": self.load_s,
            "loaded": self.loaded,
            "dtype": blink.dtype_name(engine.model.dtype),
            "matmul": engine.matmul,
            "gated_delta_layers": engine.gated_delta_layers,
            "weights_mb": round(tensor_bytes(engine.model.state_dict().values()) / 2**20),
            "dense_gflop_per_token": round(engine.prefill_cost.token_flops / 1e9, 3),
        }

    def prompts(self) -> dict[str, list[tuple[list[int], list[int], tuple[int, ...]]]]:
        """Each case's rendered prompts: (ids, label ids, cut points)."""
        return {
            case: [(p.ids, p.cand, tuple(p.cuts)) for p in self.engine.render(request)]
            for case, request in self.requests.items()
        }

    def start(self) -> None:
        """Kept prefixes dropped, then the warm-up question asked (the template header kept)."""
        self.engine.prefixes.clear()
        self.engine.forward(self.requests["warm"])

    def ask(self, case: str) -> dict:
        """One case: its wall seconds, tokens computed and each prompt's label distribution."""
        request = self.requests[case]
        start = time.perf_counter()
        forward = self.engine.forward(request)
        wall = time.perf_counter() - start
        labels = [blink.softmax(forward.readouts[p.qkey].logits[0], 1.0) for p in self.engine.render(request)]
        return {"wall_s": wall, "computed_tokens": forward.prefill_tokens, "labels": labels}


class LlamaCases:
    """A llama.cpp arm over blink's rendered prompts (in this process; its LlamaReader computes in a child)."""

    def __init__(self, reader: isolated.Child, prompts: dict):
        self.reader, self.prompts = reader, prompts

    def start(self) -> None:
        """Checkpoints dropped, then the warm-up prompt read (its header checkpoint kept)."""
        self.reader.call("forget")
        for ids, cand, cuts in self.prompts["warm"]:
            self.reader.call("read", ids, cand, cuts)

    def ask(self, case: str) -> dict:
        """One case's prompts read in order: wall seconds, tokens evaluated, label distributions."""
        before = self.reader.call("tokens_evaluated")
        start = time.perf_counter()
        reads = [self.reader.call("read", ids, cand, cuts) for ids, cand, cuts in self.prompts[case]]
        wall = time.perf_counter() - start
        computed = self.reader.call("tokens_evaluated") - before
        return {
            "wall_s": wall,
            "computed_tokens": computed,
            "labels": [blink.softmax(logits, 1.0) for logits, _ in reads],
        }


def run_rounds(arms: dict, reps: int) -> dict:
    """Every case `reps` times, each case asked of every arm in turn before the next case (a new document each time:
    the kept prefixes dropped before "document"): each arm's cases by name."""
    out: dict = {name: {} for name in arms}
    for _ in range(reps):
        for case in CASES:
            for name, arm in arms.items():
                if case != "again":
                    arm.start()
                got = arm.ask(case)
                row = out[name].setdefault(case, {"wall_s": [], "computed_tokens": got["computed_tokens"]})
                row["wall_s"].append(round(got["wall_s"], 3))
                row["labels"] = got["labels"]
                print(f"  {name} {case}: {got['wall_s']:.2f} s, {got['computed_tokens']} tokens computed", flush=True)
    return out


def open_blink(folder: str, settings: dict, threads: int, doc_tokens: int) -> tuple[dict, isolated.Child]:
    """One blink arm loaded in a child process of its own: what it loaded, and the child."""
    child = isolated.Child("blink", BlinkArm, folder, settings, threads, doc_tokens)
    try:
        return child.call("describe"), child
    except BaseException:
        child.close()
        raise


class _Remote:
    """An arm object in a child process, called as if here."""

    def __init__(self, child: isolated.Child):
        self.child = child

    def start(self) -> None:
        self.child.call("start")

    def ask(self, case: str) -> dict:
        return self.child.call("ask", case)


def open_llama(folder: str, kind: str, threads: int, prompts: dict, cache_dir: str) -> tuple[dict, isolated.Child]:
    """One llama.cpp arm: the folder's GGUF file at `kind` loaded in a child process of its own, sized for blink's
    prompts: what it loaded, and the child."""
    watch = harness.Stopwatch()
    gguf = qwen_gguf.gguf_file(folder, kind, cache_dir)
    made_s, watch = round(watch.seconds(), 2), harness.Stopwatch()
    n_ctx = max((len(ids) for case in prompts.values() for ids, _, _ in case), default=8176) + 16
    reader = isolated.Child("llama.cpp", llamacpp.LlamaReader, gguf, n_ctx, threads, True)
    try:
        row = {"gguf": os.path.basename(gguf), "gguf_mb": os.path.getsize(gguf) // 2**20, "made_s": made_s}
        row.update(load_s=round(watch.seconds(), 2), loaded=memory_mb(reader.process.pid))
        row["system_info"] = reader.call("system_info")
        return row, reader
    except BaseException:
        reader.close()
        raise


def finish(opened: dict, prompts: dict, reps: int) -> dict:
    """The opened arms ({name: (row, child)}) asked the cases in rounds (none where reps is 0), then their memory
    read: each arm's row (the caller closes them: close())."""
    asked = {
        name: LlamaCases(child, prompts) if name in LLAMA_ARMS else _Remote(child)
        for name, (_, child) in opened.items()
    }
    cases = run_rounds(asked, reps) if reps else {}
    rows = {}
    for name, (row, child) in opened.items():
        rows[name] = {**row, **({"cases": cases[name]} if reps else {}), "after": memory_mb(child.process.pid)}
    return rows


def close(opened: dict) -> None:
    """The opened arms' child processes ended, and the arms forgotten."""
    while opened:
        opened.popitem()[1][1].close()


def compare_labels(reference: list[list[float]], other: list[list[float]]) -> dict:
    """The largest probability difference over the prompts, and the prompts whose pick moved where the reference's
    top two stand more than KEPT_MARGIN apart."""
    diff = max(abs(a - b) for ref, got in zip(reference, other) for a, b in zip(ref, got))
    moved = [
        i
        for i, (ref, got) in enumerate(zip(reference, other))
        if ref.index(max(ref)) != got.index(max(got)) and answers.margin(dict(enumerate(ref))) > KEPT_MARGIN
    ]
    return {"max_prob_diff": round(diff, 5), "picks_moved": moved}


def flags(parser) -> None:
    """shape4b's own flags."""
    parser.add_argument("--shape", choices=sorted(qwen_gguf.SHAPES), help="the model's shape (4b; quick: small)")
    parser.add_argument("--arms", help="the arms to run, comma-separated (default: all)")
    parser.add_argument("--doc-tokens", type=int, help="the log's length in tokens (3400; quick 600)")
    parser.add_argument("--reps", type=int, help="every case this many times (default 1)")
    parser.add_argument("--load-only", action="store_true", help="load each arm in bfloat16 and read its memory")
    parser.add_argument("--name", default="shape4b", help="the results file's name (default shape4b)")
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="every arm loaded at once, each case asked of every arm in turn (memory for all arms at once)",
    )


def skipped_reason(name: str) -> str | None:
    """Why an arm does not run on this machine, or None."""
    if name == "blink_bfloat16" and blink.Settings.from_env({}).compute_dtype != "bfloat16":
        return "this CPU does not compute bfloat16 natively: blink's dtype rule picks float32 here (the blink arm)"
    if name in LLAMA_ARMS and not llamacpp.importable():
        return llamacpp.SKIP_NO_PACKAGE
    return None


def main(argv: list[str] | None = None) -> int:
    """Each arm in turn, then the comparison; write JSON, print the tables and one summary line last."""
    run = harness.Run("shape4b", argv, __doc__, flags, threads="2")
    cfg = {"reps": 1, **CONFIGS["quick" if run.quick else "full"]}
    shape, load_only = run.args.shape or cfg["shape"], run.args.load_only
    doc_tokens, reps = run.args.doc_tokens or cfg["doc_tokens"], 0 if load_only else run.args.reps or cfg["reps"]
    names = run.args.arms.split(",") if run.args.arms else [*BLINK_ARMS, *LLAMA_ARMS]
    if load_only:  # what holding the model takes: blink in bfloat16, without and with int8 weights
        names = [n for n in names if n in ("blink_bfloat16", "blink_int8") or n in LLAMA_ARMS]
    cache_dir = blink.Settings.from_env({}).cache_dir
    folder = qwen_gguf.qwen_folder(shape, cache_dir)
    run.probe_dtypes = ["bfloat16"]
    run.probe()
    rows, skipped, prompts, opened = {}, {}, {"warm": []}, {}
    first = [] if load_only else ["blink"]  # the reference first: its prompts are what llama.cpp reads
    try:
        for name in [*first, *(n for n in names if n not in first)]:
            reason = None if load_only else skipped_reason(name)
            if reason:
                skipped[name] = reason
                print(f"{name}: skipped ({reason})", flush=True)
                continue
            print(f"{name}: loading in a child process", flush=True)
            if name in LLAMA_ARMS:
                opened[name] = open_llama(folder, LLAMA_ARMS[name], run.threads, prompts, cache_dir)
            else:
                settings = {**BLINK_ARMS[name], **({"dtype": "bfloat16"} if load_only else {})}
                opened[name] = open_blink(folder, settings, run.threads, doc_tokens)
                prompts = opened[name][1].call("prompts") if name == "blink" else prompts
            if not run.args.interleave:  # one arm at a time: asked, read and closed before the next loads
                rows.update(finish(opened, prompts, reps))
                close(opened)
        rows.update(finish(opened, prompts, reps))
    finally:
        close(opened)
    run.probe()
    res = {
        "model": {"kind": "random-weight Qwen3.5 text model", "shape": shape, **qwen_gguf.SHAPES[shape]},
        "load_only": load_only,
        "doc_tokens": doc_tokens,
        "reps": reps,
        "interleaved": run.args.interleave,
        "arms": rows,
        "skipped": skipped,
    }
    if not load_only:
        compare_arms(rows, prompts)
        res["targets"] = targets(res, run.matmul_probe(rows["blink"]["dtype"])[1])
    path = run.write(res, run.args.name)
    print("\n".join(shape4b_table(res)))
    print(summary(res, path))
    return 0


def compare_arms(rows: dict, prompts: dict) -> None:
    """Each arm's label distributions held against blink's at its defaults (in place of the distributions), and each
    case's prompt tokens."""
    reference = {case: got["labels"] for case, got in rows["blink"]["cases"].items()}
    for row in rows.values():
        for case, got in row["cases"].items():
            got.update(compare_labels(reference[case], got.pop("labels")))
            got["prompt_tokens"] = sum(len(ids) for ids, _, _ in prompts[case])


def seconds(row: dict, case: str) -> float:
    """An arm's median seconds on a case."""
    return statistics.median(row["cases"][case]["wall_s"])


def targets(res: dict, probe_gflops: float) -> dict:
    """The issue's measures: blink's document rate against the dense limit (the probe over the dense GFLOP a token),
    the short question against its dense floor, and each arm's time over blink's on every case."""
    arms, blink_row = res["arms"], res["arms"]["blink"]
    per_token = blink_row["dense_gflop_per_token"]
    doc = blink_row["cases"]["document"]
    short = blink_row["cases"]["short"]
    out = {
        "probe_gflops": round(probe_gflops, 1),
        "document_tokens_per_s": round(doc["computed_tokens"] / seconds(blink_row, "document"), 1),
        "dense_limit_tokens_per_s": round(probe_gflops / per_token, 1),
        "short_floor_s": round(short["computed_tokens"] * per_token / probe_gflops, 3),
    }
    out["document_share_of_limit"] = round(out["document_tokens_per_s"] / out["dense_limit_tokens_per_s"], 3)
    out["short_over_floor"] = round(seconds(blink_row, "short") / out["short_floor_s"], 2)
    out["speedup_over"] = {
        name: {case: round(seconds(row, case) / seconds(blink_row, case), 2) for case in CASES}
        for name, row in arms.items()
        if name != "blink"
    }
    return out


def summary(res: dict, path: str) -> str:
    """The run's last line."""
    model, gb = res["model"], lambda mb: f"{mb / 1024:.1f} GB"  # noqa: E731
    where = f"Qwen3.5 {model['shape']} shape on {blink.hardware()}"
    if res.get("load_only"):
        peaks = ", ".join(f"{name} {gb(row['after']['peak_rss_mb'])}" for name, row in res["arms"].items())
        return f"{where}: peak resident memory, loading included: {peaks}; results {os.path.relpath(path)}"
    got = res["targets"]
    over = "; ".join(
        f"{name} {'/'.join(str(v) for v in cases.values())}x blink's time"
        for name, cases in got["speedup_over"].items()
    )
    return (
        f"{where}: blink's new document at {got['document_share_of_limit']} of the dense limit, its short question "
        f"{got['short_over_floor']}x its floor; short/document/again: {over}; results {os.path.relpath(path)}"
    )


def shape4b_table(res: dict) -> list[str]:
    """bench/shape4b.py: each arm's seconds, tokens computed and distance from blink per case, and its memory."""
    gb = lambda mb: f"{mb / 1024:.1f} GB"  # noqa: E731
    cases = list(next(iter(res["arms"].values())).get("cases", {}))  # (a file from before "again" has two)
    head = ["arm", "load s"]
    for case in cases:
        head += [f"{case} s", f"{case} computed", f"{case} max prob diff"]
    head += ["resident after load", "resident after the runs", "peak resident (load included)", "weights"]
    rows = []
    for name, row in res["arms"].items():
        cells = [name, row["load_s"]]
        for case in cases:
            got = row["cases"][case]
            walls = ", ".join(f"{w:.2f}" for w in got["wall_s"])
            cells += [walls, got.get("computed_tokens", "not counted"), got.get("max_prob_diff", "not compared")]
        memory = [row["loaded"]["rss_mb"], row["after"]["rss_mb"], row["after"]["peak_rss_mb"]]
        rows.append(cells + [*map(gb, memory), gb(row["weights_mb"]) if "weights_mb" in row else "in its GGUF file"])
    lines = report.table(head, rows)
    if "targets" in res:
        got = res["targets"]
        lines += [
            "",
            f"blink: new document {got['document_tokens_per_s']} computed tokens/s against a dense limit of "
            f"{got['dense_limit_tokens_per_s']} ({got['document_share_of_limit']}); short question "
            f"{got['short_over_floor']}x its floor of {got['short_floor_s']} s (probe {got['probe_gflops']} GFLOP/s)",
        ]
    lines += [f"{name}: skipped, {why}" for name, why in res.get("skipped", {}).items()]
    return lines


REPORT = (shape4b_table, ("arms", "targets", "model", "load_only", "doc_tokens", "reps", "skipped"))
