"""Bulk decisions: a dataset in, one answer per row out (resumable), serially or on Ray.

`python blink.py batch IN --out OUT`. IN is JSON Lines, one request a line ({"id", "state", "questions",
"images"}; `id` text or a whole number, the line number when absent), or Parquet (the same columns) where pyarrow is
installed. OUT is JSON Lines in input order: {"id", "answers", "meta"} per answered row, {"id", "error", "loc"} per
refused one. Rows go in chunks of BLINK_BATCH_MAX_REQUESTS through decide_many (packed into shared forwards under
BLINK_TOKEN_BUDGET); each chunk is written and flushed as it lands, so a crash loses at most the rows in flight. Run
again, OUT's ids are skipped and a half-written last line is cut off. `--ray N` answers the same chunks on N Ray Data
workers, each building its own engine from the same Settings.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import blink

PARQUET_SUFFIXES = (".parquet", ".pq")
PROGRESS_EVERY_S = 10.0  # how often progress is printed as a new line when stderr is not a terminal


class EngineFault(RuntimeError):
    """The engine (or a Ray worker) failed outside any one request: the run stops, what was written stays."""


@dataclass(frozen=True)
class Row:
    """One row of a dataset: its id, where it stands ("line 7", "row 7") and its request body, or why it is refused."""

    id: str | int
    where: str
    body: dict | None = None
    error: blink.BlinkError | None = None


def id_key(row_id) -> str:
    """An id as OUT compares it: 7 and "7" are different ids."""
    return json.dumps(row_id, ensure_ascii=False)


def body_row(body, n: int, unit: str) -> Row:
    """A parsed line (or Parquet row) number n as a Row: its own id, else its number; refused when it is not an object
    with a state and questions, or its id is not text or a whole number."""
    where = f"{unit} {n}"
    if not isinstance(body, dict):
        return Row(
            n,
            where,
            error=blink.BlinkError(
                f"{where} must be a JSON object with state and questions (got {type(body).__name__})", ["body"]
            ),
        )
    row_id = body.get("id")
    if row_id is None:
        row_id = n
    elif (
        isinstance(row_id, bool)
        or not isinstance(row_id, (str, int))
        or (isinstance(row_id, str) and not blink.is_text(row_id))
    ):
        return Row(
            n,
            where,
            error=blink.BlinkError(f"{where}: id must be text or a whole number (got {row_id!r:.80})", ["body", "id"]),
        )
    for name in ("state", "questions"):
        if name not in body:
            return Row(row_id, where, error=blink.BlinkError(f"{where} has no {name}", ["body", name]))
    return Row(row_id, where, body)


def open_file(path: str, mode: str):
    """A file opened in binary mode for reading ("rb") or appending ("ab"), or a BlinkError naming it."""
    try:
        return open(path, mode)
    except OSError as exc:
        raise blink.BlinkError(f"cannot {'read' if 'r' in mode else 'write'} {path}: {exc.strerror}") from None


def line_row(raw: bytes, n: int) -> Row:
    """Line n of a JSON Lines file as a Row (a line that is not UTF-8 or not JSON is refused on its own)."""
    where = f"line {n}"
    try:
        body = json.loads(raw.decode("utf-8-sig"))  # a byte-order mark some editors put first is not part of the JSON
    except UnicodeDecodeError:
        return Row(n, where, error=blink.BlinkError(f"{where} is not UTF-8 text", ["body"]))
    except json.JSONDecodeError as exc:
        return Row(n, where, error=blink.BlinkError(f"{where} is not JSON: {exc.msg} at column {exc.colno}", ["body"]))
    except RecursionError:
        return Row(n, where, error=blink.BlinkError(f"{where} nests too deep to read", ["body"]))
    except ValueError as exc:  # an integer with more digits than Python converts
        return Row(n, where, error=blink.BlinkError(f"{where} cannot be read: {exc}", ["body"]))
    return body_row(body, n, "line")


def _jsonl_rows(path: str) -> Iterator[Row]:
    """Every non-blank line of a JSON Lines file as a Row, numbered from 1 as an editor numbers them."""
    with open_file(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            if raw.strip():
                yield line_row(raw, n)


def parquet_row(values: dict, n: int) -> Row:
    """Row n of a Parquet file as a Row. A value JSON has no type for (a date, bytes, a decimal) is refused, so every
    row is JSON, as a JSON Lines row is. `questions` may be JSON text (Arrow fills a struct's missing keys with nulls,
    so JSON that varies from row to row is best stored as text): blink.parse_request reads it as every entry does."""
    row = body_row(values, n, "row")
    try:
        json.dumps(values)
    except (TypeError, ValueError) as exc:
        return replace(
            row, body=None, error=blink.BlinkError(f"{row.where} holds a value JSON cannot hold: {exc}", ["body"])
        )
    return row


def _parquet_rows(path: str) -> Iterator[Row]:
    """Every row of a Parquet file as a Row, numbered from 1."""
    if importlib.util.find_spec("pyarrow") is None:
        raise blink.BlinkError("reading Parquet needs pyarrow (pip install pyarrow)")
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow's own error types vary by what is wrong with the file
        raise blink.BlinkError(f"{path} cannot be read as Parquet: {exc}") from None
    n, batches = 0, table.iter_batches(batch_size=1024)
    while True:
        try:
            values = next(batches).to_pylist()
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001 - a damaged page: the file cannot be run (found before any row runs)
            raise blink.BlinkError(f"{path} cannot be read past row {n}: {exc}") from None
        for row in values:
            n += 1
            yield parquet_row(row, n)


def read_rows(path: str) -> Iterator[Row]:
    """The rows of a dataset file: Parquet by its suffix, JSON Lines otherwise."""
    if not os.path.isfile(path):
        raise blink.BlinkError(f"{path} is not a file")
    return _parquet_rows(path) if path.lower().endswith(PARQUET_SUFFIXES) else _jsonl_rows(path)


def dataset_ids(rows: list[Row]) -> set[str]:
    """Every row's id key, or a BlinkError naming the first id two rows share (resuming needs each id once)."""
    seen: dict[str, str] = {}
    for row in rows:
        key = id_key(row.id)
        if key in seen:
            raise blink.BlinkError(
                f"{row.where}: id {row.id!r:.80} is also the id of {seen[key]}; every id must be "
                "unique (a row without an id is known by its line number)"
            )
        seen[key] = row.where
    return set(seen)


@dataclass(frozen=True)
class Resume:
    """What OUT already holds: the ids answered or refused, the model that answered, where its last whole line ends
    and whether a half-written line follows it."""

    done: frozenset = frozenset()
    model: str | None = None
    end: int = 0
    cut: bool = False


def read_out(path: str) -> Resume:
    """What an earlier run left in OUT (nothing when OUT does not exist); a whole line that is not a batch result is
    refused, so a run never appends to some other file."""
    if not os.path.exists(path):
        return Resume()
    done, model, end = set(), None, 0
    with open_file(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            if not raw.endswith(b"\n"):  # a line cut short by a crash: answered again
                break
            end += len(raw)
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (ValueError, RecursionError):
                record = None
            if not isinstance(record, dict) or "id" not in record:
                raise blink.BlinkError(f"{path} line {n} is not a blink batch result; choose another --out")
            done.add(id_key(record["id"]))
            if not model and isinstance(record.get("meta"), dict):
                model = record["meta"].get("model")
    return Resume(frozenset(done), model, end, end < os.path.getsize(path))


def row_chunks(rows: Iterator[Row], size: int) -> Iterator[list[Row]]:
    """Rows in chunks of `size`, in order."""
    chunk: list[Row] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


ASKED = ("state", "questions", "images")  # what Deployment.parse_many reads of a row's body


def chunk_asks(rows: list[Row]) -> list[dict]:
    """The decide_many requests of a chunk's readable rows: the parts of their bodies Deployment.parse_many reads
    (the id and any other column stay behind, and so never travel to a Ray worker)."""
    return [{k: r.body[k] for k in ASKED if k in r.body} for r in rows if r.error is None]


def outcome(result) -> dict:
    """What OUT says for one decide_many result: {answers, meta}, or {error, loc} for a refused request. Any other
    failure is the engine's, not the request's: it stops the run (and the row is tried again on resume)."""
    if isinstance(result, blink.BlinkError):
        return {"error": str(result), "loc": result.loc}
    if isinstance(result, Exception):
        raise EngineFault(f"the engine failed: {type(result).__name__}: {result}") from result
    return result


def decide_outcomes(
    served: blink.Deployment, asks: list[dict], temperature: float | None, model: str | None
) -> list[dict]:
    """One chunk's requests answered together by decide_many (packed into shared forwards), one outcome each."""
    return [outcome(r) for r in served.decide_many(asks, temperature, model)] if asks else []


def chunk_records(rows: list[Row], outcomes: list[dict]) -> list[dict]:
    """OUT's records for a chunk, in row order: each readable row's outcome, each unreadable row's refusal."""
    answered = iter(outcomes)
    return [{"id": r.id, **(next(answered) if r.error is None else outcome(r.error))} for r in rows]


def jsonl_line(record: dict) -> bytes:
    """One record as a UTF-8 JSON line (escaped to ASCII when it holds text no encoding can write)."""
    try:
        return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(record) + "\n").encode("utf-8")


def load_engine(served: blink.Deployment, model: str | None) -> blink.Engine:
    """The served model's engine, loaded; a model that cannot load stops the run as an EngineFault naming why."""
    try:
        return served.engine(model)
    except blink.BlinkError:
        raise
    except Exception as exc:  # noqa: BLE001 - missing files, no hub access, out of memory: all stop the run
        raise EngineFault(f"the model could not be loaded: {type(exc).__name__}: {exc}") from exc


def serial_outcomes(
    served: blink.Deployment, chunks: Iterator[list[Row]], temperature: float | None, model: str | None
) -> Iterator[tuple[list[Row], list[dict]]]:
    """Each chunk with its outcomes, answered in this process."""
    for rows in chunks:
        yield rows, decide_outcomes(served, chunk_asks(rows), temperature, model)


class RayWorker:
    """One Ray Data worker: builds its own deployment from the driver's Settings once (on the hardware it was given,
    with that hardware's defaults where the driver's were its own), then answers chunks, each a JSON list of
    row bodies, with the same steps as a serial run."""

    def __init__(self, settings: blink.Settings, temperature: float | None, model: str | None):
        self.served = blink.Deployment(settings.on_hardware(gpu=blink.cuda_available()))
        load_engine(self.served, model)  # now, not inside the first chunk
        self.temperature, self.model = temperature, model

    def __call__(self, table):
        """A pyarrow table of chunks as JSON text -> a table of their outcomes as JSON text."""
        import pyarrow as pa

        return pa.table(
            {
                "outcomes": [
                    json.dumps(decide_outcomes(self.served, json.loads(asks), self.temperature, self.model))
                    for asks in table.column("asks").to_pylist()
                ]
            }
        )


def ray_connect(address: str | None):
    """Ray, connected: to the cluster at `address` (blink.py shipped to its workers), else to a new local one."""
    if importlib.util.find_spec("ray") is None:
        raise blink.BlinkError(
            "--ray needs Ray: pip install 'ray[data]' (tools/requirements-ray.txt pins the tested version)"
        )
    for name, value in (("RAY_USAGE_STATS_ENABLED", "0"), ("RAY_DATA_DISABLE_PROGRESS_BARS", "1")):
        os.environ.setdefault(name, value)
    import ray

    quiet = dict(logging_level=logging.ERROR, log_to_driver=False)
    try:
        if address:
            ray.init(address=address, runtime_env={"py_modules": [blink, sys.modules["adapters"]]}, **quiet)
        else:  # "local": a cluster of this machine alone, never one another program started
            ray.init(address="local", include_dashboard=False, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise blink.BlinkError(f"cannot start or join Ray{f' at {address}' if address else ''}: {exc}") from None
    return ray


def ray_worker_resources(cluster: Mapping[str, float], workers: int) -> tuple[float, float]:
    """(CPUs, GPUs) each worker asks for: one GPU each when the cluster has GPUs (refused when too few); a share of
    the CPUs that leaves one free for Ray Data's own tasks (an actor pool holding every CPU starves them)."""
    gpus = cluster.get("GPU", 0)
    if gpus and gpus < workers:
        raise blink.BlinkError(f"--ray {workers} needs a GPU per worker; the cluster has {gpus:g}")
    cpus = min(1.0, max(0.1, (cluster.get("CPU", 1) - 1) / workers))
    return round(cpus, 2), 1.0 if gpus else 0.0


def ray_outcomes(
    settings: blink.Settings,
    chunks: Iterator[list[Row]],
    temperature: float | None,
    model: str | None,
    workers: int,
    address: str | None,
) -> Iterator[tuple[list[Row], list[dict]]]:
    """Each chunk with its outcomes, answered by `workers` Ray Data workers (one engine each) and returned in order.
    Chunks and outcomes travel as JSON text, one string column: Arrow never infers a schema from a request (every
    row's body came from JSON, or was checked to be JSON, so the text holds exactly what the serial run answers)."""
    chunks = list(chunks)
    if not chunks:
        return
    ray = ray_connect(address)
    try:
        import ray.data

        logging.getLogger("ray.data").setLevel(logging.ERROR)
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        cpus, gpus = ray_worker_resources(ray.cluster_resources(), workers)
        items = [{"asks": json.dumps(chunk_asks(rows))} for rows in chunks]
        answered = ray.data.from_items(items).map_batches(
            RayWorker,
            fn_constructor_kwargs={"settings": settings, "temperature": temperature, "model": model},
            batch_size=1,
            batch_format="pyarrow",
            num_cpus=cpus,
            num_gpus=gpus,
            # one chunk at a time per worker: the worker whose model loaded first must not queue every chunk up
            compute=ray.data.ActorPoolStrategy(size=workers, max_tasks_in_flight_per_actor=1),
        )
        landed = iter(chunks)
        try:
            for table in answered.iter_batches(batch_size=1, batch_format="pyarrow"):
                for text in table.column("outcomes").to_pylist():
                    yield next(landed), json.loads(text)
        except ray.exceptions.RayError as exc:
            raise EngineFault(f"the Ray job failed: {_first_line(exc)}") from None
    finally:
        ray.shutdown()


def _first_line(exc: BaseException) -> str:
    """The last line of an exception's message that names an error (Ray wraps the worker's traceback in its own)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    named = [line for line in lines if "Error" in line or "Exception" in line]
    return (named or lines or [type(exc).__name__])[-1][:500]


@dataclass(frozen=True)
class BatchStats:
    """Where a batch run stands: rows to answer this run (`total`), rows written, refusals among them, rows skipped
    because OUT had them, whether a half-written line was cut off, seconds since answering began (model loading
    excluded for a serial run; a Ray run includes starting its workers) and until the first chunk landed, and the
    model and engine that answered."""

    total: int
    rows: int = 0
    errors: int = 0
    skipped: int = 0
    repaired: bool = False
    seconds: float = 0.0
    first_s: float | None = None
    model: str = ""
    engine: str = ""
    fabricated: bool = False
    workers: int = 0
    held: int = 0  # records OUT held when the run began

    @property
    def rate(self) -> float:
        """Rows written per second."""
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    def eta_s(self) -> float | None:
        """Seconds left at the current rate (None before the first rows)."""
        return (self.total - self.rows) / self.rate if self.rate > 0 else None

    def summary(self) -> str:
        """The run's last line: rows, errors, speed, model and engine."""
        engine = self.engine or "—"
        if self.fabricated:
            engine += " (fabricated numbers)"
        if self.workers:
            engine += f" on {self.workers} Ray worker{'s' * (self.workers > 1)}"
        notes = [f"first rows after {self.first_s:.1f} s"] if self.first_s is not None else []
        if self.skipped:
            notes.append(f"{self.skipped} already in OUT")
        if self.repaired:
            notes.append("a half-written last line redone")
        return (
            f"batch: {self.rows} rows, {self.errors} errors in {self.seconds:.1f} s ({self.rate:.1f} rows/s)"
            + "".join(f"; {n}" for n in notes)
            + f"; model {self.model}, engine {engine}"
        )


def batch_steps(
    in_path: str,
    out_path: str,
    served: blink.Deployment | None = None,
    temperature: float | None = None,
    model: str | None = None,
    workers: int = 0,
    address: str | None = None,
) -> Iterator[BatchStats]:
    """Answer every row of IN not yet in OUT and append it to OUT in input order, yielding where the run stands
    after setting up and after each chunk. Bad rows become refusals in OUT; input that cannot be run at all (a
    duplicate id, an unknown model, an OUT that is not a batch result) is refused before anything is written."""
    served = served or blink.deployment()
    if temperature is not None:
        blink.check_temperature(temperature)
    model_id = served.model_id(model)
    if os.path.abspath(in_path) == os.path.abspath(out_path):
        raise blink.BlinkError("--out must be another file than the input")
    rows = list(read_rows(in_path))  # read once: its ids are checked before anything is written
    ids = dataset_ids(rows)
    resume = read_out(out_path)
    if resume.model and resume.model != model_id:
        raise blink.BlinkError(
            f"{out_path} holds answers from {resume.model}; this run serves {model_id}: choose another --out"
        )
    skipped = len(ids & resume.done)
    stats = BatchStats(
        len(ids) - skipped, skipped=skipped, repaired=resume.cut, model=model_id, workers=workers, held=len(resume.done)
    )
    pending = (row for row in rows if id_key(row.id) not in resume.done)
    chunks = row_chunks(pending, served.settings.batch_max_requests)
    with open_file(out_path, "ab") as fh:
        fh.truncate(resume.end)  # a half-written last line goes; its row is answered again
        yield stats
        if workers:
            answered = ray_outcomes(served.settings, chunks, temperature, model, workers, address)
        else:
            answered = serial_outcomes(served, chunks, temperature, model)
            if stats.total:
                load_engine(served, model)  # before the clock starts
        t0 = time.perf_counter()
        for rows, outcomes in answered:
            records = chunk_records(rows, outcomes)
            fh.write(b"".join(jsonl_line(r) for r in records))
            fh.flush()
            os.fsync(fh.fileno())
            meta = next((r["meta"] for r in records if "meta" in r), {})
            seconds = time.perf_counter() - t0
            stats = replace(
                stats,
                rows=stats.rows + len(records),
                seconds=seconds,
                errors=stats.errors + sum("error" in r for r in records),
                first_s=seconds if stats.first_s is None else stats.first_s,
                engine=stats.engine or meta.get("engine", ""),
                fabricated=stats.fabricated or bool(meta.get("fabricated")),
            )
            yield stats


def batch(
    in_path: str,
    out_path: str,
    served: blink.Deployment | None = None,
    temperature: float | None = None,
    model: str | None = None,
    workers: int = 0,
    address: str | None = None,
) -> BatchStats:
    """batch_steps run to the end: the final BatchStats."""
    stats = None
    for stats in batch_steps(in_path, out_path, served, temperature, model, workers, address):  # noqa: B007 (the last one)
        pass
    return stats


def _clock(seconds: float | None) -> str:
    """Seconds as h:mm:ss or m:ss ("--" when unknown)."""
    if seconds is None or not math.isfinite(seconds):
        return "--"
    m, s = divmod(int(seconds + 0.5), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


def progress_line(stats: BatchStats, width: int = 24) -> str:
    """One progress line: a bar, rows done of all, rows/s, errors and the time left."""
    done = stats.rows / stats.total if stats.total else 1.0
    bar = "#" * int(done * width) + "-" * (width - int(done * width))
    return (
        f"batch [{bar}] {stats.rows}/{stats.total} rows  {stats.rate:.1f} rows/s  {stats.errors} errors  "
        f"ETA {_clock(stats.eta_s())}"
    )


class Progress:
    """Draws BatchStats on a stream: one line redrawn in place on a terminal, a new line every PROGRESS_EVERY_S
    seconds otherwise; nothing when quiet."""

    def __init__(self, stream, quiet: bool = False):
        self.stream, self.quiet = stream, quiet
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.shown_at = -math.inf

    def show(self, stats: BatchStats) -> None:
        """Draw the progress line if it is time to."""
        now = time.monotonic()
        if self.quiet or now - self.shown_at < (0.1 if self.tty else PROGRESS_EVERY_S):
            return
        self.shown_at = now
        self.stream.write(f"\r{progress_line(stats)}\033[K" if self.tty else progress_line(stats) + "\n")
        self.stream.flush()

    def end(self, stats: BatchStats | None, stopped: str | None = None) -> None:
        """The summary line (and why the run stopped, with how to resume)."""
        if self.quiet and not stopped:
            return
        lines = [stats.summary()] if stats is not None and not self.quiet else []
        if stopped:
            lines.append(f"{stopped}; run the same command again to resume")
        self.stream.write(("\r\033[K" if self.tty else "") + "".join(line + "\n" for line in lines))
        self.stream.flush()


# ---- command line ------------------------------------------------------------------------------------------------


def read_back(out_path: str, stats: BatchStats | None) -> BatchStats | None:
    """stats with the rows this run has in OUT as read back from the file: Ctrl-C can land between a chunk's write
    and its count."""
    if stats is None:
        return None
    try:
        return replace(stats, rows=len(read_out(out_path).done) - stats.held)
    except (OSError, blink.BlinkError):
        return stats


def run_batch(args: argparse.Namespace) -> int:
    """Answer the dataset with progress on stderr, then the summary line; 130 when interrupted, 1 when the engine
    failed (what was written stays: the same command resumes)."""
    show = Progress(sys.stderr, args.quiet)
    if args.quiet:  # nor the bar transformers draws while the model loads
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    stats = None
    try:
        for stats in batch_steps(
            args.data, args.out, blink.deployment(), args.temperature, args.model, args.ray, args.ray_address
        ):
            show.show(stats)
    except KeyboardInterrupt:
        stats = read_back(args.out, stats)
        show.end(stats, f"interrupted: {stats.rows if stats else 0} rows of this run are in {args.out}")
        return 130
    except EngineFault as exc:
        show.end(stats, f"stopped: {exc}")
        return 1
    show.end(stats)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python blink.py batch IN --out OUT [--ray N]`: 0 when done, 2 for input refused before anything ran."""
    parser = argparse.ArgumentParser(prog="blink.py batch", description="answer every row of a dataset, resumably")
    parser.add_argument("data", help="the requests, JSON Lines or Parquet")
    parser.add_argument("--out", required=True, help="the JSON Lines file answers are appended to")
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--model", default=None, help="one of the served models (BLINK_MODELS)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no summary line")
    parser.add_argument(
        "--ray",
        type=int,
        default=0,
        metavar="N",
        help="answer on N Ray Data workers, one engine each (one GPU each where there are GPUs)",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="with --ray: join the Ray cluster at ADDR (host:port, or auto) instead of starting one on this machine",
    )
    args = parser.parse_args(argv)
    if args.ray < 0 or (args.ray_address and not args.ray):
        parser.error("--ray takes a number of workers of at least 1; --ray-address needs --ray")
    try:
        return run_batch(args)
    except blink.BlinkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
