"""Bulk decisions over a dataset (`python blink.py batch IN --out OUT`): every row answered once and in order, a bad
row refused in its place, resuming after a crash, malformed files, Parquet, and the same job on a local Ray cluster
giving the serial run's answers."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import pytest
from conftest import ROOT, free_port
from hypothesis import given, settings
from hypothesis import strategies as st

import blink
from adapters import bulk
from bench.lib import servers

QUESTIONS = {
    "team": {
        "type": "choice",
        "instructions": "Which team should handle this ticket?",
        "criteria": ["billing", "technical", "account"],
    },
    "urgent": {"type": "noul", "instructions": "Is the customer blocked right now?"},
}
# Bad lines, each with where blink's refusal must point (the `loc` of its {"id", "error", "loc"} record).
BAD_LINES = [
    (b"{not json", ["body"]),
    (b"[1, 2]", ["body"]),
    (json.dumps({"state": "no questions here"}).encode(), ["body", "questions"]),
    (
        json.dumps({"state": "x", "questions": {"q": {"type": "score", "criteria": [1]}}}).encode(),
        ["body", "questions", "q", "criteria"],
    ),
    (json.dumps({"questions": QUESTIONS}).encode(), ["body", "state"]),
    (json.dumps({"id": 1.5, "state": "x", "questions": QUESTIONS}).encode(), ["body", "id"]),
    (json.dumps({"state": "x", "questions": QUESTIONS, "images": "not a list"}).encode(), ["body", "images"]),
    (b"\xff\xfe\x00\x9c binary garbage", ["body"]),
    (b"17", ["body"]),
]
TIMING = ("latency_ms", "model_ms")  # the only parts of a record that differ between two runs of the same rows


def make_dataset(path, n: int, questions: dict = QUESTIONS, bad_every: int = 11) -> list[dict]:
    """A JSON Lines file of n rows, every bad_every-th a bad line (cycling through BAD_LINES), a blank line now and
    then, every third row with an id of its own. Returns what each record of OUT must be, in order: {"id", and
    "loc" for a refused row or "request" (state, questions) for an answered one}."""
    lines, expected, bad = [], [], iter(BAD_LINES * n)
    for i in range(n):
        if i % 17 == 16:
            lines.append(b"   ")  # blank lines are skipped, yet counted in line numbers
        number = len(lines) + 1
        if i % bad_every == bad_every - 1:
            raw, loc = next(bad)
            lines.append(raw)
            expected.append({"id": number, "loc": loc})
            continue
        row = {
            "state": f"Ticket {i}: the card was charged twice and the app crashes at login ({i % 5} times).",
            "questions": questions,
        }
        if i % 3 == 0:
            row["id"] = f"t{i}"
        lines.append(json.dumps(row).encode())
        expected.append({"id": row.get("id", number), "request": (row["state"], questions)})
    path.write_bytes(b"\n".join(lines) + b"\n")
    return expected


def records(path) -> list[dict]:
    """OUT's records, every line a whole JSON object."""
    with open(path, "rb") as fh:
        return [json.loads(line) for line in fh]


def untimed(recs: list[dict]) -> list[dict]:
    """Records without the timings that differ from run to run."""
    return [{**r, "meta": {k: v for k, v in r["meta"].items() if k not in TIMING}} if "meta" in r else r for r in recs]


def check_against(
    recs: list[dict],
    expected: list[dict],
    served: blink.Deployment | None = None,
    tolerance: float = 0.0,
    every: int = 1,
) -> None:
    """Every expected row once, in order; refusals where expected, with their loc; answers (of every `every`-th row)
    equal to the same request decided alone (within `tolerance`) when `served` is given."""
    assert [r["id"] for r in recs] == [e["id"] for e in expected]
    for i, (rec, exp) in enumerate(zip(recs, expected)):
        if "loc" in exp:
            assert set(rec) == {"id", "error", "loc"} and rec["loc"] == exp["loc"], rec
            assert rec["error"] and "Traceback" not in rec["error"]
        else:
            assert set(rec) == {"id", "answers", "meta"}, rec
            if served is not None and i % every == 0:
                alone = served.decide(*exp["request"])["answers"]
                assert rec["answers"].keys() == alone.keys()
                for qkey, answer in alone.items():
                    for option, p in answer["probabilities"].items():
                        assert abs(rec["answers"][qkey]["probabilities"][option] - p) <= tolerance, (rec["id"], qkey)


@pytest.fixture(scope="module")
def mock_dep() -> blink.Deployment:
    """The mock engine served the way `BLINK_MOCK=1 python blink.py batch` serves it (the default model's id)."""
    return blink.Deployment(blink.Settings(engine="mock"))


@pytest.fixture(scope="module")
def big(tmp_path_factory, mock_dep):
    """A 300-row dataset with bad lines, answered once in full by the mock engine: (IN, expected, OUT records)."""
    folder = tmp_path_factory.mktemp("big")
    expected = make_dataset(folder / "in.jsonl", 300)
    stats = bulk.batch(str(folder / "in.jsonl"), str(folder / "out.jsonl"), mock_dep)
    return folder / "in.jsonl", expected, records(folder / "out.jsonl"), stats


def test_every_row_is_answered_once_in_order_with_refusals_in_place(big, mock_dep):
    _, expected, recs, stats = big
    check_against(recs, expected, mock_dep)
    refused = sum("loc" in e for e in expected)
    assert refused >= len(BAD_LINES) and stats.rows == len(expected) == 300 and stats.errors == refused
    assert stats.total == 300 and stats.skipped == 0 and stats.engine == "mock" and stats.fabricated
    assert all(r["meta"]["fabricated"] is True for r in recs if "meta" in r)
    # rows shared forwards: each decide_many call took a chunk of BLINK_BATCH_MAX_REQUESTS rows
    assert max(r["meta"]["input_tokens"] for r in recs if "meta" in r) > 0
    assert "fabricated numbers" in stats.summary() and "300 rows, " in stats.summary()


def test_resume_after_out_was_cut_mid_line(big, mock_dep, tmp_path):
    in_path, expected, full, _ = big
    out = tmp_path / "out.jsonl"
    lines = (in_path.parent / "out.jsonl").read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:100]) + lines[100][: len(lines[100]) // 2])  # killed while writing row 101
    stats = bulk.batch(str(in_path), str(out), mock_dep)
    assert stats.skipped == 100 and stats.repaired and stats.rows == 200 and stats.total == 200
    assert "100 already in OUT" in stats.summary() and "half-written" in stats.summary()
    resumed = records(out)
    assert untimed(resumed) == untimed(full)  # nothing written twice, nothing lost, the same order
    again = bulk.batch(str(in_path), str(out), mock_dep)  # a finished run has nothing left to do
    assert (again.rows, again.skipped, again.total) == (0, 300, 0) and records(out) == resumed


class Dies(blink.MockEngine):
    """A mock engine whose process dies (KeyboardInterrupt) or whose device fails (RuntimeError) at its n-th call."""

    def __init__(self, settings, at: int, error: BaseException):
        super().__init__(None, settings)
        self.calls, self.at, self.error = 0, at, error

    def run(self, jobs):
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return super().run(jobs)


@pytest.mark.parametrize(
    "error", [KeyboardInterrupt(), RuntimeError("CUDA out of memory")], ids=["interrupted", "engine failed"]
)
def test_a_run_that_stops_keeps_whole_chunks_and_resumes(big, mock_dep, tmp_path, error):
    in_path, _, full, _ = big
    out = tmp_path / "out.jsonl"
    dying = blink.Deployment.serving(Dies(mock_dep.settings, 3, error))
    raised = KeyboardInterrupt if isinstance(error, KeyboardInterrupt) else bulk.EngineFault
    with pytest.raises(raised) as caught:
        bulk.batch(str(in_path), str(out), dying)
    if raised is bulk.EngineFault:
        assert "CUDA out of memory" in str(caught.value)
    kept = records(out)  # two whole chunks: the third was in flight
    assert len(kept) == 2 * mock_dep.settings.batch_max_requests and untimed(kept) == untimed(full[: len(kept)])
    stats = bulk.batch(str(in_path), str(out), mock_dep)
    assert stats.skipped == len(kept) and not stats.repaired and untimed(records(out)) == untimed(full)


def test_an_interrupt_reports_the_rows_out_holds_even_between_a_write_and_its_count(big, mock_dep, tmp_path):
    in_path = big[0]
    out = tmp_path / "out.jsonl"
    steps = bulk.batch_steps(str(in_path), str(out), mock_dep)
    start = next(steps)
    first = next(steps)  # one chunk written; Ctrl-C now, before the caller saw a later count
    assert bulk.read_back(str(out), start).rows == first.rows == len(records(out)) > 0
    steps.close()
    again = next(bulk.batch_steps(str(in_path), str(out), mock_dep))  # a resumed run: OUT held rows already
    assert again.held == first.rows and bulk.read_back(str(out), again).rows == 0
    assert bulk.read_back(str(out), None) is None


def test_input_that_cannot_run_is_refused_before_anything_is_written(tmp_path, mock_dep):
    out = tmp_path / "out.jsonl"
    dup = tmp_path / "dup.jsonl"
    row = {"state": "x", "questions": QUESTIONS}
    dup.write_text("\n".join(json.dumps(r) for r in ({**row, "id": 3}, row, row)) + "\n")  # line 3's id is 3
    with pytest.raises(blink.BlinkError, match=r"line 3: id 3 is also the id of line 1; every id must be unique"):
        bulk.batch(str(dup), str(out), mock_dep)
    assert not out.exists()
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(row) + "\n")
    for kwargs, message in (
        ({"model": "org/other"}, "unknown model 'org/other'"),
        ({"temperature": -1.0}, "temperature must be a finite number above 0"),
    ):
        with pytest.raises(blink.BlinkError, match=message):
            bulk.batch(str(good), str(out), mock_dep, **kwargs)
        assert not out.exists()
    with pytest.raises(blink.BlinkError, match="another file than the input"):
        bulk.batch(str(good), str(good), mock_dep)
    with pytest.raises(blink.BlinkError, match="is not a file"):
        bulk.batch(str(tmp_path / "missing.jsonl"), str(out), mock_dep)
    with pytest.raises(blink.BlinkError, match="cannot write .*No such file or directory"):
        bulk.batch(str(good), str(tmp_path / "no-such-folder" / "out.jsonl"), mock_dep)
    stranger = tmp_path / "notes.txt"
    stranger.write_text("my notes\n")
    with pytest.raises(blink.BlinkError, match="notes.txt line 1 is not a blink batch result"):
        bulk.batch(str(good), str(stranger), mock_dep)
    assert stranger.read_text() == "my notes\n"
    other = blink.Deployment(blink.Settings(engine="mock", models=(("org/other", None),)))
    bulk.batch(str(good), str(out), other)
    with pytest.raises(blink.BlinkError, match="holds answers from org/other; this run serves"):
        bulk.batch(str(good), str(out), mock_dep)


def test_a_model_that_cannot_load_stops_the_run_by_name(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"state": "x", "questions": QUESTIONS}) + "\n")
    missing = blink.Deployment(blink.Settings(engine="torch", models=((str(tmp_path / "no-model"), None),)))
    with pytest.raises(bulk.EngineFault, match="the model could not be loaded: OSError"):
        bulk.batch(str(src), str(tmp_path / "out.jsonl"), missing)
    assert (tmp_path / "out.jsonl").read_bytes() == b""


@pytest.mark.parametrize(
    ("content", "locs"),
    [
        (b"", []),
        (b"\n  \n\r\n", []),
        (b"not json at all\n", [["body"]]),
        (b'[{"state": "x", "questions": {"q": {"type": "noul"}}}]\n', [["body"]]),
        (b'{"state": "x"}\n', [["body", "questions"]]),
        (b'{"state": "x", "questions": null}\n', [["body", "questions"]]),
        (bytes(range(11, 256)) + b"\n\x00\x00\x00\n", [["body"], ["body"]]),
        (b'{"state": "x", "questions": {"q": {"type": "noul"}}}', [None]),  # no newline at the end of the file
        (b'\xef\xbb\xbf{"state": "x", "questions": {"q": {"type": "noul"}}}\r\n', [None]),  # BOM, CRLF
        (b'{"state": "x", "questions": {"q": {"type": "noul"}}, "id": "\\ud800"}\n', [["body", "id"]]),
        (b'{"state": ' + b"[" * 5000 + b"]" * 5000 + b', "questions": {"q": {"type": "noul"}}}\n', [["body"]]),
        (b'{"state": ' + b"9" * 5000 + b', "questions": {"q": {"type": "noul"}}}\n', [["body"]]),
    ],
    ids=[
        "empty",
        "blank lines",
        "not JSON",
        "a list",
        "no questions",
        "null questions",
        "binary",
        "no final newline",
        "BOM and CRLF",
        "lone surrogate id",
        "too deep",
        "huge integer",
    ],
)
def test_malformed_files_give_one_record_per_line(tmp_path, mock_dep, content, locs):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(content)
    stats = bulk.batch(str(src), str(out), mock_dep)
    recs = records(out)
    assert [r.get("loc") for r in recs] == locs and stats.rows == len(locs)
    assert stats.errors == sum(loc is not None for loc in locs)


VALID = st.fixed_dictionaries(
    {"state": st.text(max_size=30), "questions": st.just({"q": {"type": "noul"}})}, optional={"images": st.just([])}
)
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8,
)
LINE = st.one_of(
    VALID.map(json.dumps).map(str.encode),
    JSON_VALUES.map(json.dumps).map(str.encode),
    st.binary(max_size=30),
    st.text(max_size=30).map(lambda s: s.encode("utf-8", "surrogatepass")),
)


@settings(max_examples=60, deadline=None)
@given(lines=st.lists(LINE, max_size=10))
def test_fuzzed_files_never_stop_the_run(mock_dep, lines):
    lines = [line.replace(b"\n", b" ") for line in lines]
    with tempfile.TemporaryDirectory() as folder:
        src, out = os.path.join(folder, "in.jsonl"), os.path.join(folder, "out.jsonl")
        with open(src, "wb") as fh:
            fh.write(b"\n".join(lines))
        try:
            bulk.batch(src, out, mock_dep)
        except blink.BlinkError as exc:  # a JSON object that happened to carry an id another line has
            assert "every id must be unique" in str(exc) and not os.path.exists(out)
            return
        recs = records(out)
        assert len(recs) == sum(bool(line.strip()) for line in lines)
        assert len({json.dumps(r["id"]) for r in recs}) == len(recs)
        assert all(set(r) in ({"id", "answers", "meta"}, {"id", "error", "loc"}) for r in recs)


def test_parquet_gives_what_the_same_json_lines_give(tmp_path, mock_dep):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [
        {"id": f"p{i}", "state": f"Ticket {i}: refund please", "questions": json.dumps(QUESTIONS)} for i in range(40)
    ]
    rows[7]["questions"] = "{broken"
    rows[9]["id"] = None  # known by its row number
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    import datetime

    dated = pa.Table.from_pylist([{"id": "d", "state": datetime.date(2026, 1, 2), "questions": json.dumps(QUESTIONS)}])
    pq.write_table(dated, tmp_path / "dated.parquet")
    bulk.batch(str(tmp_path / "dated.parquet"), str(tmp_path / "dated.jsonl"), mock_dep)
    (refused,) = records(tmp_path / "dated.jsonl")
    assert refused["id"] == "d" and refused["loc"] == ["body"]
    assert refused["error"].startswith("row 1 holds a value JSON cannot hold: Object of type date")
    stats = bulk.batch(str(tmp_path / "in.parquet"), str(tmp_path / "pq.jsonl"), mock_dep)
    from_parquet = records(tmp_path / "pq.jsonl")
    as_lines = [{**r, "questions": json.loads(r["questions"])} if r["questions"] != "{broken" else r for r in rows]
    (tmp_path / "in.jsonl").write_text(
        "\n".join(json.dumps({k: v for k, v in r.items() if v is not None}) for r in as_lines) + "\n"
    )
    bulk.batch(str(tmp_path / "in.jsonl"), str(tmp_path / "jl.jsonl"), mock_dep)
    from_lines = records(tmp_path / "jl.jsonl")
    assert stats.rows == 40 and stats.errors == 1 and from_parquet[9]["id"] == 10
    assert from_parquet[7] == {
        "id": "p7",
        "loc": ["body", "questions"],
        "error": "questions is not valid JSON: Expecting property name enclosed in double quotes at line 1, column 2",
    }
    assert [r.get("answers") for r in from_parquet] == [r.get("answers") for r in from_lines]
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(blink.BlinkError, match="cannot be read as Parquet"):
        bulk.batch(str(tmp_path / "bad.parquet"), str(tmp_path / "x.jsonl"), mock_dep)


def test_a_ray_worker_answers_a_chunk_as_the_serial_steps_do(mock_dep):
    pa = pytest.importorskip("pyarrow")
    asks = [("Ticket 1: refund please", QUESTIONS, None), ("x", {"q": {"type": "noul", "multi": 3}}, None)]
    worker = bulk.RayWorker(mock_dep.settings, None, None)
    (text,) = worker(pa.table({"asks": [json.dumps(asks)]})).column("outcomes").to_pylist()
    serial = json.loads(json.dumps(bulk.decide_outcomes(mock_dep, asks, None, None)))
    assert untimed(json.loads(text)) == untimed(serial) and "answers" in serial[0]
    assert serial[1]["loc"] == ["body", "questions", "q", "multi"]


def test_a_worker_takes_its_own_hardware_defaults_and_keeps_what_was_set(mock_dep):
    # A driver on a CPU (or ZeroGPU) sends its Settings; a worker on a GPU takes a GPU's defaults for what the
    # driver left to the hardware, and keeps what was set (in the environment, or replaced afterwards).
    cpu = blink.Settings.from_env({"BLINK_ENGINE": "mock", "BLINK_PREFIX_KV_TOKENS": "1000"}, gpu=False)
    on_gpu = cpu.on_hardware(gpu=True)
    assert (cpu.token_budget, on_gpu.token_budget) == (4096, 32768)
    assert on_gpu.prefix_kv_tokens == 1000 and on_gpu.compute_dtype == "bfloat16" and on_gpu.prefix_cache
    changed = replace(cpu, token_budget=512, prefix_cache=False).on_hardware(gpu=True)
    assert (changed.token_budget, changed.prefix_cache) == (512, False)
    zero = blink.Settings.from_env({"BLINK_ENGINE": "mock"}, gpu=True)
    zero = replace(zero, zero_gpu=True, prefix_cache_mb=None, derived=())
    assert zero.prefix_cache_mb == 0 and zero.on_hardware(gpu=True).prefix_cache_mb == 1024
    assert cpu.on_hardware(gpu=False) == cpu  # the same hardware: the same settings
    worker = bulk.RayWorker(replace(mock_dep.settings, zero_gpu=True, prefix_cache_mb=None, derived=()), None, None)
    assert worker.served.settings.prefix_cache_mb == 1024 and not worker.served.settings.zero_gpu  # no GPU here


def test_ray_workers_take_a_gpu_each_and_leave_a_cpu_free():
    assert bulk.ray_worker_resources({"CPU": 2.0}, 2) == (0.5, 0.0)
    assert bulk.ray_worker_resources({"CPU": 64.0, "GPU": 8.0}, 8) == (1.0, 1.0)
    assert bulk.ray_worker_resources({"CPU": 1.0}, 4) == (0.1, 0.0)
    with pytest.raises(blink.BlinkError, match="needs a GPU per worker; the cluster has 2"):
        bulk.ray_worker_resources({"CPU": 16.0, "GPU": 2.0}, 4)


def cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """python blink.py ARGS, as a user runs it."""
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "blink.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_cli_shows_progress_and_a_summary_and_quiet_shows_nothing(big, tmp_path):
    in_path, _, full, _ = big
    out = tmp_path / "out.jsonl"
    done = cli("batch", str(in_path), "--out", str(out), env={"BLINK_MOCK": "1"})
    assert done.returncode == 0 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert lines[0].startswith("batch [") and "0/300 rows" in lines[0] and "ETA" in lines[0]
    assert lines[-1].startswith("batch: 300 rows, 27 errors in ") and "rows/s" in lines[-1]
    assert lines[-1].endswith(f"; model {blink.STANDIN_MODEL}, engine mock (fabricated numbers)")
    assert untimed(records(out)) == untimed(full)
    out.unlink()
    quiet = cli("batch", str(in_path), "--out", str(out), "--quiet", env={"BLINK_MOCK": "1"})
    assert quiet.returncode == 0 and quiet.stdout == quiet.stderr == "" and len(records(out)) == 300
    for args, message in (
        (("--temperature", "0"), "error: temperature must be a finite number above 0"),
        (("--model", "org/nope"), "error: unknown model 'org/nope'"),
    ):
        refused = cli("batch", str(in_path), "--out", str(tmp_path / "new.jsonl"), *args, env={"BLINK_MOCK": "1"})
        assert refused.returncode == 2 and refused.stderr.startswith(message) and "Traceback" not in refused.stderr
    missing = cli("batch", str(in_path), env={"BLINK_MOCK": "1"})
    assert missing.returncode == 2 and "the following arguments are required: --out" in missing.stderr


# ---- the stand-in model, serially and on a local Ray cluster -------------------------------------------------------

SMALL = {"urgent": {"type": "noul", "instructions": "Is the customer blocked?"}}
# Small chunks, so an interrupted run has whole chunks behind it; one CPU thread, as each Ray worker here has, so the
# serial and the Ray runs sum the full-vocabulary label mass in the same order (more threads split the sums otherwise).
CHUNK_ENV = {"BLINK_BATCH_MAX_REQUESTS": "8", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def standin_run(tmp_path_factory):
    """The stand-in over 40 rows (4 bad) by the command line, stopped with Ctrl-C after its first chunk landed and
    run again to the end: (IN, expected, the interrupted run, the resumed run, OUT)."""
    folder = tmp_path_factory.mktemp("standin")
    expected = make_dataset(folder / "in.jsonl", 40, SMALL, bad_every=10)
    out = folder / "out.jsonl"
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "blink.py"), "batch", str(folder / "in.jsonl"), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **CHUNK_ENV},
        # Ctrl-C as at a terminal, even when this test runs where SIGINT is ignored (a background job)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 240
    while not (out.exists() and out.stat().st_size) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stopped = subprocess.CompletedProcess(proc.args, *([proc.wait(60)] + list(proc.communicate())))
    kept = records(out)
    resumed = cli("batch", str(folder / "in.jsonl"), "--out", str(out), env=CHUNK_ENV)
    return folder / "in.jsonl", expected, stopped, kept, resumed, out


def test_ctrl_c_keeps_whole_chunks_and_the_same_command_resumes(standin_run, standin, served):
    _, expected, stopped, kept, resumed, out = standin_run
    assert stopped.returncode == 130, stopped.stderr
    assert stopped.stderr.splitlines()[-1] == (
        f"interrupted: {len(kept)} rows of this run are in {out}; run the same command again to resume"
    )
    assert kept and len(kept) % 8 == 0 and len(kept) < 40  # whole chunks only
    assert resumed.returncode == 0, resumed.stderr
    summary = resumed.stderr.splitlines()[-1]
    assert f"{len(kept)} already in OUT" in summary and summary.endswith(f"model {blink.STANDIN_MODEL}, engine torch")
    recs = records(out)
    assert recs[: len(kept)] == kept
    # every row once, in order; each answer what the same request gets alone (packing changes float sums only)
    check_against(recs, expected, served(standin), tolerance=1e-4, every=7)
    assert all(r["meta"]["engine"] == "torch" and r["meta"]["batched_requests"] > 1 for r in recs if "meta" in r)


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster for this module (`ray start --head --block`), reached at 127.0.0.1 with a token of its
    own; yields the environment a driver joins it with. Ray's memory monitor is off: other programs on a shared
    machine must not get this cluster's workers killed."""
    pytest.importorskip("ray")
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    with servers.ray_temp() as temp:  # Ray's files in a folder of the cluster's own, gone afterwards
        port = free_port()
        join = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16), "RAY_USAGE_STATS_ENABLED": "0"}
        env = {**os.environ, **join, "RAY_memory_monitor_refresh_ms": "0", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
        log = open(os.path.join(temp, "start.log"), "w")
        head = subprocess.Popen(
            [
                ray_bin,
                "start",
                "--head",
                "--block",
                f"--port={port}",
                "--node-ip-address=127.0.0.1",
                "--num-cpus=2",
                "--include-dashboard=false",
                f"--temp-dir={temp}",
                "--disable-usage-stats",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            deadline = time.monotonic() + 120
            while True:
                assert head.poll() is None, open(os.path.join(temp, "start.log")).read()[-3000:]
                assert time.monotonic() < deadline, "the Ray cluster did not come up in time"
                if "Ray runtime started" in open(os.path.join(temp, "start.log")).read():
                    break
                time.sleep(0.5)
            yield {**join, "RAY_TMPDIR": temp, "RAY_ADDRESS_FOR_TEST": f"127.0.0.1:{port}"}
        finally:
            head.send_signal(signal.SIGTERM)  # `ray start --block` stops every process it started
            try:
                head.wait(90)
            except subprocess.TimeoutExpired:
                head.kill()
                head.wait(10)
            log.close()


def ray_cli(in_path, out, cluster: dict, extra_env: dict) -> subprocess.CompletedProcess:
    """python blink.py batch IN --out OUT --ray 2 joining the test's cluster."""
    return cli(
        "batch",
        str(in_path),
        "--out",
        str(out),
        "--ray",
        "2",
        "--ray-address",
        cluster["RAY_ADDRESS_FOR_TEST"],
        env={**cluster, **extra_env},
        timeout=400,
    )


def test_ray_gives_the_serial_answers_on_the_standin(standin_run, ray_cluster, tmp_path):
    in_path, expected, _, _, _, serial_out = standin_run
    out = tmp_path / "ray.jsonl"
    done = ray_cli(in_path, out, ray_cluster, CHUNK_ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = done.stderr.splitlines()[-1]
    assert summary.startswith("batch: 40 rows, 4 errors in ") and summary.endswith("engine torch on 2 Ray workers")
    recs = records(out)
    check_against(recs, expected)
    assert untimed(recs) == untimed(records(serial_out))  # the same chunks through the same steps: the same numbers


def test_ray_resumes_a_cut_out_and_matches_the_serial_run(big, ray_cluster, tmp_path):
    in_path, _, full, _ = big
    out = tmp_path / "ray.jsonl"
    lines = (in_path.parent / "out.jsonl").read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:100]) + lines[100][:40])
    done = ray_cli(in_path, out, ray_cluster, {"BLINK_MOCK": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "100 already in OUT; a half-written last line redone" in done.stderr.splitlines()[-1]
    assert untimed(records(out)) == untimed(full)
