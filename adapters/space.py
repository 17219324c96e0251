"""What a Gradio Space adds around the HTTP layer (adapters/http.py): the Blocks that is the whole app, the key rule
for Gradio's own routes, MCP where it can run, and ZeroGPU's hand-off.

Space, a gr.Blocks, is the whole app however it is served. Its theme and CSS are its own (a caller's CSS is added
after them; Gradio fills a theme nobody chose with its plain Default, which the Space's replaces). Gradio has no hook
for a Blocks to bring routes or middleware, so serve_spaces() wraps gradio's App.create_app once: every App Gradio
builds for a Space (`launch()`, reload mode's relaunch, `gr.mount_gradio_app`, Ray Serve's Gradio ingress) gets the
Space's HTTP layer installed (the /v1 routes, /metrics, the body limit and the key in front of every route), MCP on
where it can run (with tool results written as JSON), and no other Blocks is touched.

The key and Gradio's routes (PageRule). With BLINK_API_KEY set, Gradio's API needs the key as /v1 does, and the page
stays as open as the Space. The page and gradio_client both call functions through Gradio's routes: a queue join
(POST /gradio_api/queue/join) or, for an event that skips the queue, POST /gradio_api/run/<name>, each naming the
function by its index. What tells them apart is not a header (the page's client sends `x-gradio-user: app`,
gradio_client `api`, and anyone can send either) but what they call: the page calls only its own events, which are
private (api_visibility="private": not in the API, not MCP tools), while gradio_client and MCP call the API's
functions (decide, decide_batch, info: public). So the key is needed for
  - a queue join or a run call unless it names one of the page's private events (its body is read, within the body
    limit, and the function found as Gradio finds it: by index, else by the name in the path);
  - every call by name (/gradio_api/call/..., what curl-style clients use) and all of MCP (/gradio_api/mcp/...; its
    tool calls then run through the queue with the caller's headers, key included);
and not for the page, its assets and config, the queue's event stream (a session's own results), uploads, files and
the API's description (/gradio_api/info, which MCP's own client reads without the caller's headers). A person who
wants the page closed too turns on Gradio's own login (launch(auth=...)) or makes the Space private.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os

import gradio as gr
from gradio.context import LocalContext

from adapters import http, wire

log = logging.getLogger("blink.app")
KEYED_PREFIXES = ("/gradio_api/mcp", "/gradio_api/call/")  # always keyed
RUN_PREFIXES = ("/gradio_api/run/", "/gradio_api/api/")  # keyed unless they name a page event (as is the queue join)
QUEUE_JOIN = "/gradio_api/queue/join"

# ==================================================================================================================
# The key on Gradio's routes
# ==================================================================================================================


class PageRule(http.KeyRule):
    """Gradio's API and MCP need the key; the page's own calls do not (the module docstring says how they differ)."""

    def __init__(self, app):
        self.app = app  # the Gradio App: its Blocks now (reload mode swaps them) say which events are the page's

    def needs_key(self, path: str, body: bytes | None) -> bool | None:
        """True for MCP and calls by name; for a queue join or a run call, unless its body names a page event."""
        if path.startswith(KEYED_PREFIXES):
            return True
        if path.rstrip("/") != QUEUE_JOIN and not path.startswith(RUN_PREFIXES):
            return False
        return None if body is None else not self.page_event(path, body)

    def page_event(self, path: str, body: bytes) -> bool:
        """True when a call names one of the page's own (private) events, found as Gradio finds the function it runs
        (route_utils.get_fn): by the body's fn_index, else by the name a run path ends in."""
        try:
            call = json.loads(body)
        except (ValueError, RecursionError):
            return False
        index = call.get("fn_index") if isinstance(call, dict) else None
        fns = self.app.get_blocks().fns
        if index is not None:
            fn = fns.get(index) if isinstance(index, int) else None
        elif path.startswith(RUN_PREFIXES):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            fn = next((f for f in fns.values() if f.api_name == name), None)
        else:
            fn = None
        return fn is not None and fn.api_visibility == "private"


# ==================================================================================================================
# ZeroGPU: the caller's quota token into the answering thread; its refusals as statuses clients retry
# ==================================================================================================================


class ZeroGpu(http.Handoff):
    """On ZeroGPU, @spaces.GPU charges the caller whose X-IP-Token (which Hugging Face adds to every request) it
    finds in Gradio's request context. A /v1 route has none of its own, so its answering thread is handed that one
    header, as a Gradio event would be (nothing else of the request, the API key least of all); ZeroGPU's scheduling
    refusals become statuses a client retries. Tested off a Space only."""

    def carry(self, request) -> gr.Request | None:
        """The caller's quota token as Gradio's request context holds it (None: an anonymous call)."""
        token = request.headers.get("x-ip-token")
        return gr.Request(headers={"x-ip-token": token}) if token else None

    def enter(self, carried: gr.Request | None) -> None:
        """The quota token in the answering thread's Gradio request context."""
        if carried is not None:
            LocalContext.request.set(carried)

    def refusal(self, exc: Exception) -> Exception:
        """A ZeroGPU scheduling refusal (a gr.Error titled "ZeroGPU ...") as a wire error a client retries: over
        quota 429 (after a minute), no GPU free 503; any other error as it is."""
        title = str(getattr(exc, "title", "") or "")
        if not (isinstance(exc, gr.Error) and title.startswith("ZeroGPU")):
            return exc
        quota = "quota" in title.lower() or "credits" in title.lower()
        return wire.WireError(
            f"{title}: {exc.message}",
            [],
            429 if quota else 503,
            "rate_limit_exceeded" if quota else "overloaded",
            retry_after=60 if quota else 5,
        )


# ==================================================================================================================
# MCP: on where Gradio's MCP server can run, its results as JSON
# ==================================================================================================================


def mcp_problem() -> str | None:
    """Why Gradio's MCP server cannot run here (None: it can): it needs the `mcp` package below 2 (gradio[mcp])."""
    try:
        version = importlib.metadata.version("mcp")
    except importlib.metadata.PackageNotFoundError:
        return "the mcp package is not installed (pip install 'gradio[mcp]')"
    if int(version.split(".")[0]) >= 2:
        return f"mcp {version} is installed and Gradio's MCP server needs mcp < 2 (the vLLM environment pins mcp >= 2)"
    return None


def mcp_default() -> bool:
    """Whether a Space serves MCP when whoever builds its App does not say: where it can run, saying so where not."""
    problem = mcp_problem()
    if problem:
        log.warning(
            "blink: MCP is off: %s; agents can call /v1/systemone, /v1/decisions or the Gradio API (gradio_client)",
            problem,
        )
    return problem is None


def json_results(server) -> None:
    """MCP tool results as JSON text an agent parses: Gradio writes a tool's dict or list result with str(), Python's
    repr. This server's result writer is given JSON text instead (file results keep Gradio's own handling)."""
    from gradio_client import utils as client_utils

    write = server.postprocess_output_data
    if getattr(write, "writes_json", False):
        return

    def write_json(data, root_url: str):
        as_json = [
            json.dumps(v, ensure_ascii=False)
            if isinstance(v, (dict, list)) and not client_utils.is_file_obj_with_meta(v)
            else v
            for v in data
        ]
        return write(as_json, root_url)

    write_json.writes_json = True
    server.postprocess_output_data = write_json


# ==================================================================================================================
# The Space
# ==================================================================================================================


class Space(gr.Blocks):
    """A Blocks that is the whole app however it is served: its theme and CSS, and on every App Gradio builds for
    it (serve_spaces) its HTTP layer and MCP. Server-side rendering stays off when it is launched: with it (Spaces
    turn it on) a Node front answers every path but Gradio's own, the /v1 routes included."""

    def __init__(self, layer: http.HttpLayer, css: str, theme: gr.themes.Base, **kwargs):
        self.layer, self.page_css, self.page_theme = layer, css, theme
        self._chosen_css = self._chosen_theme = None
        super().__init__(**kwargs)
        serve_spaces()

    @property
    def css(self) -> str:
        """The page's CSS, then whatever a launch or a mount added."""
        return self.page_css + (self._chosen_css or "")

    @css.setter
    def css(self, value: str | None) -> None:
        self._chosen_css = value

    @property
    def theme(self) -> gr.themes.Base:
        """The page's theme, unless a launch or a mount chose another (not Gradio's Default, its stand-in for
        none)."""
        chosen = self._chosen_theme
        return self.page_theme if chosen is None or type(chosen) is gr.themes.Default else chosen

    @theme.setter
    def theme(self, value) -> None:
        self._chosen_theme = value

    def launch(self, *args, **kwargs):
        """Gradio's launch, server-side rendering off unless asked for."""
        kwargs.setdefault("ssr_mode", False)
        return super().launch(*args, **kwargs)

    def validate_inputs(self, block_fn, inputs: list) -> None:
        """Gradio's check that an event got all its inputs, without copying what the caller sent into the error
        (Gradio prints it to the log, whatever its size)."""
        if len(inputs) < len(block_fn.inputs):
            raise ValueError(
                f"An event handler ({block_fn.name}) didn't receive enough input values "
                f"(needed: {len(block_fn.inputs)}, got: {len(inputs)})."
            )

    def serve_on(self, app) -> None:
        """The Space's HTTP layer on an App Gradio built for it (with the page rule for the key), and MCP results as
        JSON."""
        self.layer.install(app, PageRule(app))
        if self.mcp_server_obj is not None:
            json_results(self.mcp_server_obj)


def serve_spaces() -> None:
    """Wrap gradio's App.create_app once, so every App it builds for a Space serves the Space whole (MCP on where it
    runs, unless the caller or GRADIO_MCP_SERVER says); every other Blocks is built as Gradio builds it."""
    from gradio.routes import App

    build = App.create_app
    if getattr(build, "serves_spaces", False):
        return

    def create_app(blocks, *args, **kwargs):
        if isinstance(blocks, Space) and kwargs.get("mcp_server") is None and "GRADIO_MCP_SERVER" not in os.environ:
            kwargs["mcp_server"] = mcp_default()
        app = build(blocks, *args, **kwargs)
        if isinstance(blocks, Space):
            blocks.serve_on(app)
        return app

    create_app.serves_spaces = True
    App.create_app = staticmethod(create_app)
