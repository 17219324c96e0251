"""README.md and docs/ document every setting blink.py and app.py read, with the defaults the code has, so the docs
cannot drift from the code; their client examples run against the launched app; and every docs/ page is reachable
from README's index. The figures they quote from results files are tests/test_figures.py's."""

from __future__ import annotations

import inspect
import json
import os
import re
from dataclasses import fields

import blink
from adapters.http import ServerSettings
from adapters.serve import RouteSettings

SETTINGS_CLASSES = (blink.Settings, ServerSettings, RouteSettings)  # the engine's, the server's, Ray Serve's router's
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTING = re.compile(r"[\"'](BLINK_[A-Z][A-Z0-9_]*)[\"']")  # a quoted name: each is an environment variable
# Read in Settings.from_env itself rather than from a field of their own.
FROM_ENV_ONLY = {"BLINK_MOCK", "BLINK_MODEL", "BLINK_MODELS", "BLINK_REVISION"}
CONFIGURATION = "docs/configuration.md"  # the Environment variables table
SECURITY = "docs/security.md"  # the limits tables
TICKET = "Our card was charged twice for March and now nobody on the team can log in."  # README's examples ask this


def source(name: str) -> str:
    """A file of the project, as text."""
    with open(os.path.join(ROOT, name), encoding="utf-8") as fh:
        return fh.read()


def setting_fields() -> dict:
    """Each field of the settings classes read from an environment variable, by that variable."""
    return {f.metadata["env"]: f for cls in SETTINGS_CLASSES for f in fields(cls) if "env" in f.metadata}


def settings_class(name: str) -> type:
    """The settings class whose field a variable sets."""
    return next(cls for cls in SETTINGS_CLASSES if any(f.metadata.get("env") == name for f in fields(cls)))


def from_env(name: str, env: dict):
    """The settings (of the class that reads `name`) built from `env`."""
    cls = settings_class(name)
    return cls.from_env(env, gpu=False) if cls is blink.Settings else cls.from_env(env)


def variables_read() -> set[str]:
    """Every BLINK_* variable the code reads: the settings fields' variables, the ones Settings.from_env reads
    itself, and any other quoted BLINK_ name in blink.py, app.py or the server's modules."""
    return (
        set(setting_fields())
        | set(SETTING.findall(inspect.getsource(blink.Settings.from_env)))
        | set(
            SETTING.findall(
                "".join(
                    map(source, ("blink.py", "app.py", "adapters/http.py", "adapters/space.py", "adapters/serve.py"))
                )
            )
        )
    )


def section(title: str, name: str = "README.md") -> str:
    """One "## " section of a markdown file of the project (README.md unless named)."""
    return source(name).split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def limits_rows() -> list[str]:
    """The table rows of the "Limits" section of docs/security.md (the request limits and the image limits)."""
    return [line for line in section("Limits", SECURITY).splitlines() if line.startswith("|")]


def variable_rows() -> list[list[str]]:
    """The cells of each row of the "Environment variables" table of docs/configuration.md (header and rule left
    out)."""
    lines = [line for line in section("Environment variables", CONFIGURATION).splitlines() if line.startswith("|")][2:]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def row_of(name: str) -> str:
    """The limits row that documents a variable."""
    rows = [row for row in limits_rows() if f"`{name}`" in row]
    assert len(rows) == 1, (name, rows)
    return rows[0]


def renderings(value) -> list[str]:
    """The ways the README writes a number: with or without thousands separators, or as MiB (width × height is
    matched by shows())."""
    number = int(value) if float(value).is_integer() else value
    out = [f"{number:,}", f"{number}"]
    if isinstance(number, int) and number >= 2**20 and number % 2**20 == 0:
        out.append(f"{number // 2**20} MiB")
    return out


def shows(row: str, value) -> bool:
    """True when the row states the number, not as part of another number."""
    if any(re.search(rf"(?<!\d)(?<!\d,){re.escape(r)}(?!\d|,\d)", row) for r in renderings(value)):
        return True
    return any(int(w) * int(h) == value for w, h in re.findall(r"(?<!\d)(\d+) × (\d+)(?!\d)", row))


def another_value(f, default) -> tuple[str, object]:
    """A valid setting for a field that differs from `default` (its default on this machine): (as the variable holds
    it, as the field holds it)."""
    m = f.metadata
    if m["kind"] is bool:
        return ("0", False) if default else ("1", True)
    if m["kind"] in (int, float):
        value = default + 1 if m["hi"] is None or default + 1 <= m["hi"] else default - 1
        return str(value), value
    if m["choices"]:
        value = next(c for c in m["choices"] if c != default)
        return value.upper(), value  # any case
    if m["json_object"]:
        return '{"seed": 1}', '{"seed": 1}'
    return "/tmp/elsewhere", "/tmp/elsewhere"


def test_each_variable_sets_its_field():
    assert FROM_ENV_ONLY <= set(SETTING.findall(inspect.getsource(blink.Settings.from_env)))
    assert len(setting_fields()) >= 29
    derived = blink.Settings.from_env({}, gpu=False).derived_defaults()
    for name, f in setting_fields().items():
        default = derived[f.name] if f.default is None and f.name in derived else f.default
        raw, value = another_value(f, default)
        assert getattr(from_env(name, {}), f.name) == default and value != default, name
        assert getattr(from_env(name, {name: raw}), f.name) == value, name


def test_every_setting_the_code_reads_is_documented():
    read = variables_read()
    documented = set(re.findall(r"`(BLINK_[A-Z0-9_]+)`", source(CONFIGURATION)))
    assert len(read) >= 30
    assert sorted(read - documented) == []
    in_table = {name for cells in variable_rows() for name in re.findall(r"`(BLINK_[A-Z0-9_]+)`", cells[0])}
    assert sorted(read - in_table) == []  # each one has its row in the Environment variables table


def test_limits_are_documented_with_the_defaults_of_the_code():
    numeric = {name: f for name, f in setting_fields().items() if f.metadata["kind"] in (int, float)}
    limits = {name: f for name, f in numeric.items() if any(f"`{name}`" in row for row in limits_rows())}
    assert {
        "BLINK_MAX_INPUT_TOKENS",
        "BLINK_MAX_REQUEST_TOKENS",
        "BLINK_MAX_JSON_DEPTH",
        "BLINK_TOKEN_BUDGET",
        "BLINK_QUEUE_SIZE",
        "BLINK_CONCURRENCY",
        "BLINK_BATCH_MAX_QUEUED",
        "BLINK_GPU_DURATION",
        "BLINK_MAX_REQUEST_CHARS",
        "BLINK_BATCH_WINDOW_MS",
        "BLINK_BATCH_MAX_REQUESTS",
        "BLINK_MAX_IMAGES",
        "BLINK_MAX_IMAGE_BYTES",
        "BLINK_MAX_IMAGE_PIXELS",
        "BLINK_MAX_IMAGE_SOURCE_PIXELS",
    } <= set(limits)
    for name, f in limits.items():
        row = row_of(name)
        for default in defaults_by_hardware(f):
            assert shows(row, default), (name, default, row)
        if f.metadata["hi"] is not None and "–" in row:  # a row that states the allowed range states the code's
            assert shows(row, f.metadata["lo"]) and shows(row, f.metadata["hi"]), (name, f.metadata, row)
    fixed = {
        "questions per request": blink.MAX_QUESTIONS,
        "options of a `choice`": blink.MAX_OPTIONS,
        "prompts one request renders": blink.MAX_PROMPTS,
        "requests in one `/decide_batch`": blink.MAX_BATCH_REQUESTS,
    }
    for label, value in fixed.items():
        rows = [row for row in limits_rows() if row.startswith(f"| {label}")]
        assert len(rows) == 1 and shows(rows[0], value), (label, value, rows)


HARDWARE = {
    "a CPU": blink.Settings(),
    "a GPU": blink.Settings(gpu=True),
    "ZeroGPU": blink.Settings(gpu=True, zero_gpu=True),
}


def defaults_by_hardware(f) -> list:
    """A field's default on a CPU, a GPU and ZeroGPU (one value unless the hardware decides it)."""
    if f.default is not None or f.name not in blink.Settings().derived_defaults():
        return [f.default]
    return sorted({getattr(s, f.name) for s in HARDWARE.values()}, key=str)


def documented_defaults(value) -> tuple[str, ...]:
    """How the Environment variables table may write a field's default (none: a default the hardware decides)."""
    if value is None or value == "":
        return ()
    if isinstance(value, bool):
        return (f"`{int(value)}`",)
    if isinstance(value, (int, float)):
        return f"`{value}`", f"`{value:g}`"
    return ("`" + value.replace(blink.HERE + os.sep, "").replace(os.path.expanduser("~"), "~") + "`",)


def test_the_variables_table_shows_the_defaults_of_the_code():
    by_name = setting_fields()
    checked = set()
    for names_cell, default_cell, *_ in variable_rows():
        names = re.findall(r"`(BLINK_[A-Z0-9_]+)`", names_cell)
        if default_cell == "see [security.md](security.md)":  # the limits tables state these (test above)
            assert all(any(f"`{name}`" in row for row in limits_rows()) for name in names), names
            checked.update(names)
            continue
        parts = [p.strip() for p in default_cell.split(", ")] if len(names) > 1 else [default_cell]
        assert len(parts) == len(names), (names, default_cell)
        for name, part in zip(names, parts):
            if name in by_name:
                f = by_name[name]
                if f.default is None and f.name in blink.Settings().derived_defaults():
                    # a default the hardware decides: the cell states it for a CPU first, and each other value
                    assert part.startswith(documented_defaults(blink.Settings().derived_defaults()[f.name])), part
                    for value in defaults_by_hardware(f):
                        assert any(w in part for w in documented_defaults(value)), (name, value, part)
                else:
                    want = documented_defaults(f.default)
                    assert not want or part.startswith(want), (name, f.default, part)
                checked.add(name)
    assert sorted(set(by_name) - checked) == []
    # the variables Settings.from_env reads itself
    mock = next(cells for cells in variable_rows() if "`BLINK_MOCK`" in cells[0])
    assert mock[1] == "`0`" and blink.Settings.from_env({}, gpu=False).engine == ""
    assert blink.Settings.from_env({"BLINK_MOCK": "1"}, gpu=False).engine == "mock"
    model = next(cells for cells in variable_rows() if "`BLINK_MODEL`" in cells[0])
    assert f"`{blink.PRODUCTION_MODEL}`" in model[1] and "stand-in" in model[1]
    assert blink.Settings.from_env({"SPACE_ID": "x"}, gpu=False).default_model == blink.PRODUCTION_MODEL
    assert blink.Settings.from_env({}, gpu=True).default_model == blink.PRODUCTION_MODEL
    assert blink.Settings.from_env({}, gpu=False).default_model == blink.STANDIN_MODEL


def code_blocks(title: str, name: str = "README.md") -> list[tuple[str, str]]:
    """The fenced code blocks of one section of a markdown file: (language, code)."""
    return re.findall(r"```(\w+)\n(.*?)```", section(title, name), re.S)


def run_example(lang: str, code: str, url: str, cwd) -> str:
    """Run one documented example as written, against the launched app at `url` rather than the documented
    http://127.0.0.1:7860; its stdout (it must exit 0)."""
    import subprocess
    import sys

    code = code.replace("http://127.0.0.1:7860", url.rstrip("/"))
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    command = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (code, done.stdout, done.stderr)
    return done.stdout


def test_the_wire_examples_run_against_the_launched_app(launched, tmp_path):
    """Every curl, typesafe-sdk and openai example of docs/wire.md, run as written against the launched app (on the
    mock engine, standing in for a model that reads images), prints the answers the served engine gives the same
    request in process."""
    from conftest import serving

    app, url = launched
    blocks = code_blocks("Routes and clients", "docs/wire.md")
    assert [lang for lang, _ in blocks] == ["bash", "python", "python", "bash"]
    reader = blink.MockEngine(app.DEPLOYMENT.default_model, app.SETTINGS)
    reader.reads_images = True
    with serving(app, reader):
        outputs = [run_example(lang, code, url, tmp_path) for lang, code in blocks]
        for lang, out in zip([lang for lang, _ in blocks], outputs):
            if lang == "bash":  # curl prints the System One response
                answers = json.loads(out)["answers"]
                assert answers and all("type" in a for a in answers.values()), out
            else:
                assert out.strip() and "Error" not in out, out
        # each example printed the answers the served engine gives the same request in process
        ticket = "I was charged twice and cannot log in."
        curl = json.loads(outputs[0])["answers"]
        want = app.DEPLOYMENT.decide(
            {"message": ticket},
            {
                "spam": {"type": "noul", "instructions": "Is this spam?", "criteria": {"true": "advertising"}},
                "queue": {"type": "choice", "criteria": {"billing": "payments", "access": None, "other": None}},
                "urgency": {"type": "score", "criteria": ["can wait", "this week", "today"]},
            },
        )["answers"]
        assert (curl["spam"]["noul"], curl["queue"]["choice"]) == (want["spam"]["noul"], want["queue"]["choice"])
        assert abs(curl["urgency"]["score"] - want["urgency"]["score"]) < 1e-12
        model, noul, choice, score = outputs[1].split()[:4]  # typesafe-sdk: model, noul, choice, score, usage
        want = app.DEPLOYMENT.decide(
            {"message": ticket},
            {
                "spam": {
                    "type": "noul",
                    "instructions": "Is this spam?",
                    "criteria": {"true": "unsolicited advertising"},
                },
                "queue": {
                    "type": "choice",
                    "instructions": "Which team?",
                    "criteria": {"billing": "payments", "access": None},
                },
                "urgency": {
                    "type": "score",
                    "instructions": "How urgent?",
                    "criteria": ["can wait", "this week", "today"],
                },
            },
        )
        assert model == want["meta"]["model"] and (float(noul), choice) == (
            want["answers"]["spam"]["noul"],
            want["answers"]["queue"]["choice"],
        )
        assert abs(float(score) - want["answers"]["urgency"]["score"]) < 1e-12
        want = app.DEPLOYMENT.decide(
            ticket,
            {  # openai: one line per answer, in question order
                "spam": {"type": "noul", "instructions": "The message is spam."},
                "queue": {
                    "type": "choice",
                    "instructions": "Which team?",
                    "criteria": {"billing": "payments", "access": None},
                },
                "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "medium", "high"]},
            },
        )
        assert outputs[2].splitlines() == [
            f"spam predicate {want['answers']['spam']['noul']} None",
            f"queue choice None {want['answers']['queue']['choice']}",
            "urgency score None None",
        ]


def test_the_batch_examples_run_against_the_launched_app(launched, tmp_path):
    """docs/wire.md's curl and httpx examples of /v1/systemone/batch, run as written against the launched app (on the
    mock engine), print each state's answers as the served engine gives that state alone."""
    from conftest import serving

    app, url = launched
    blocks = code_blocks("Batch: one question set, many states", "docs/wire.md")
    assert [lang for lang, _ in blocks] == ["bash", "python"]
    with serving(app, blink.MockEngine(app.DEPLOYMENT.default_model, app.SETTINGS)):
        curl, printed = (run_example(lang, code, url, tmp_path) for lang, code in blocks)
        queue = {"billing": "payments", "access": None, "other": None}
        states = ["I was charged twice.", "Lunch at noon?", {"message": "Cannot log in", "plan": "team"}]
        want = [
            app.DEPLOYMENT.decide(s, {"spam": {"type": "noul"}, "queue": {"type": "choice", "criteria": queue}})
            for s in states
        ]
        results = json.loads(curl)["results"]
        assert [r["answers"]["spam"]["noul"] for r in results] == [w["answers"]["spam"]["noul"] for w in want]
        assert [r["answers"]["queue"]["choice"] for r in results] == [w["answers"]["queue"]["choice"] for w in want]
        alone = [app.DEPLOYMENT.decide(s, {"spam": {"type": "noul"}})["answers"]["spam"]["noul"] for s in states[:2]]
        assert printed.strip() == str(alone)


def test_the_api_examples_run_against_the_launched_app(launched, tmp_path):
    """docs/api.md's gradio_client example, run as written against the launched app (the live stand-in), prints the
    answers the app's deployment gives the same requests in process, at the deployment's own temperature; its MCP
    example lists the tools and prints decide's result as JSON."""
    app, url = launched
    ((code,),) = [[c] for lang, c in code_blocks("Endpoints", "docs/api.md") if lang == "python"]
    assert "gradio_client" in code and "temperature=" not in code
    *_, line, noul_list = run_example("python", code, url, tmp_path).splitlines()
    choice, noul, engine = line.split()
    want = app.DEPLOYMENT.decide(
        TICKET,
        {
            "queue": {"type": "choice", "criteria": ["billing", "access", "bug"]},
            "urgent": {"type": "noul", "instructions": "Is the customer blocked right now?"},
        },
    )
    assert (choice, engine) == (want["answers"]["queue"]["choice"], want["meta"]["engine"]) == (choice, "torch")
    assert abs(float(noul) - want["answers"]["urgent"]["noul"]) < 1e-5
    batch = [
        app.DEPLOYMENT.decide(state, {"spam": {"type": "noul"}}) for state in ("WIN A FREE CRUISE", "Lunch at noon?")
    ]
    got = json.loads(noul_list)
    assert len(got) == 2 and all(abs(g - w["answers"]["spam"]["noul"]) < 1e-5 for g, w in zip(got, batch))
    ((code,),) = [[c] for lang, c in code_blocks("MCP", "docs/api.md") if lang == "python"]
    tools, result = run_example("python", code, url, tmp_path).splitlines()  # the tools, then decide's result
    assert tools == "['decide', 'decide_batch', 'info']"
    want = app.DEPLOYMENT.decide("I was charged twice.", {"refund": {"type": "noul"}})
    assert json.loads(result)["answers"] == want["answers"]


def test_the_readme_client_examples_run_against_the_launched_app(launched, tmp_path):
    """README's examples (gradio_client in the quick start; typesafe-sdk, openai and MCP under "Calling it from
    code"), each with its pip install line, run as written against the launched app (the live stand-in): each prints
    the choice, and where it prints one the p(yes), that the deployment gives README's question in process, at the
    deployment's own temperature (no example sets one)."""
    app, url = launched
    quick = [c for lang, c in code_blocks("Quick start") if lang == "python"]
    clients = [c for lang, c in code_blocks("Calling it from code") if lang == "python"]
    examples = quick + clients
    assert [re.match(r"# pip install (\S+)", c).group(1) for c in examples] == [
        "gradio_client",
        "typesafe-sdk",
        '"openai>=3.26"',
        "mcp",
    ]
    for code in examples:  # README's question, and no temperature: the deployment's calibrated or default one
        assert TICKET in code and "temperature=" not in code and not re.search(r"^\s*\d+\.\d+,", code, re.M), code
    want = app.DEPLOYMENT.decide(
        TICKET,
        {
            "queue": {"type": "choice", "instructions": "Which team?", "criteria": ["billing", "access", "bug"]},
            "urgent": {"type": "noul", "instructions": "Is the customer blocked right now?"},
        },
    )
    choice, p_yes = want["answers"]["queue"]["choice"], want["answers"]["urgent"]["noul"]
    gradio, typesafe, openai, mcp = [run_example("python", c, url, tmp_path).splitlines()[-1].split() for c in examples]
    assert [gradio[0], typesafe[0], openai[0], *mcp] == [choice] * 4, (gradio, typesafe, openai, mcp)
    assert all(abs(float(printed[1]) - p_yes) < 1e-5 for printed in (gradio, typesafe, openai))
    assert gradio[2] == "torch" and {typesafe[2], openai[2]} <= {app.DEPLOYMENT.default_model, "jev-latest"}


def test_the_space_installs_the_mcp_extra_of_its_own_gradio():
    pinned = re.search(r"^gradio\[mcp\]==(\S+)", source("requirements.txt"), re.M)
    sdk = re.search(r"^sdk_version: (\S+)", source("README.md"), re.M)
    assert pinned and sdk and pinned.group(1) == sdk.group(1)
    assert re.search(r"^backports\.zstd", source("requirements.txt"), re.M)  # zstd request bodies


def test_the_front_matter_names_the_licence_of_the_license_file():
    front = source("README.md").split("\n---\n", 1)[0]
    assert re.search(r"^license: apache-2.0$", front, re.M) and re.search(r"^tags:\n  - mcp-server$", front, re.M)
    licence = source("LICENSE")
    assert (
        "Apache License" in licence
        and "Version 2.0, January 2004" in licence
        and "END OF TERMS AND CONDITIONS" in licence
    )


FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def markdown_files() -> list[str]:
    """README.md, bench/README.md and every page of docs/, relative to the repository root."""
    docs = sorted(os.path.join("docs", n) for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
    return ["README.md", os.path.join("bench", "README.md"), *docs]


def anchor(heading: str) -> str:
    """A heading's anchor as GitHub and the Hub make it: lower case, punctuation other than hyphens dropped, each
    space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(name: str) -> set[str]:
    """The anchors of a markdown file's headings (code blocks left out)."""
    return {anchor(h) for h in re.findall(r"^#+ (.+)$", FENCE.sub("", source(name)), re.M)}


def test_every_docs_page_is_in_the_readme_index_and_every_relative_link_resolves():
    index = section("Documentation")
    pages = [name for name in markdown_files() if name.startswith("docs")]
    assert len(pages) >= 11 and [p for p in pages if f"]({p})" not in index] == []
    assert [p for p in re.findall(r"\]\((docs/[^)#]+)\)", index) if p not in pages] == []
    broken = []
    for name in markdown_files():
        for target in LINK.findall(FENCE.sub("", source(name))):
            if re.match(r"[a-z]+:", target):  # https:, mailto: ...
                continue
            path, _, fragment = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(name), path)) if path else name
            if not os.path.exists(os.path.join(ROOT, resolved)):
                broken.append((name, target))
            elif fragment and (not resolved.endswith(".md") or fragment not in anchors(resolved)):
                broken.append((name, target))
    assert broken == []


def test_the_readme_keeps_the_newcomer_path_short():
    lines = source("README.md").splitlines()
    assert len(lines) < 250
    head = "\n".join(lines[:80])  # clone, the demo and one client call
    assert "git clone https://huggingface.co/spaces/thegovind/blink" in head
    assert "bash tools/setup.sh && .venv/bin/python app.py" in head
    assert 'api_name="/decide"' in head and head.count("```") % 2 == 0


def test_the_hardened_example_is_tighter_than_the_defaults():
    """README's hardened server settings, exported by bash as written, parse into the settings they name, each
    tighter than its default; docs/security.md's table gives the same values."""
    import subprocess

    (code,) = [c for lang, c in code_blocks("Serving it yourself") if lang == "bash" and "export BLINK_" in c]
    exports = "\n".join(line for line in code.splitlines() if line.startswith("export "))
    done = subprocess.run(
        ["bash", "-c", exports + "\nenv -0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": os.environ["PATH"]},
    )
    assert done.returncode == 0, done.stderr
    env = dict(item.split("=", 1) for item in done.stdout.split("\0") if item.startswith("BLINK_"))
    key = env.pop("BLINK_API_KEY")
    assert len(key) >= 32 and ServerSettings.from_env({"BLINK_API_KEY": key}).api_key == key
    assert len(env) >= 7
    rows = [row for row in section("A hardened public server", SECURITY).splitlines() if row.startswith("| `BLINK")]
    for name, raw in env.items():
        f = setting_fields()[name]
        tight, default = getattr(from_env(name, {name: raw}), f.name), getattr(from_env(name, {}), f.name)
        assert tight == int(raw) < default, (name, tight, default)
        (row,) = [r for r in rows if f"`{name}`" in r.split("|")[1]]
        names = re.findall(r"`(BLINK_[A-Z_]+)`", row.split("|")[1])
        example = row.split("|")[3].split(", ")[names.index(name)]
        assert shows(example, int(raw)), (name, raw, row)
