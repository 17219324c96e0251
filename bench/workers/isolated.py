"""A native peer in a child process of its own: an object built and called there, so that a crash in someone else's
native code (llama.cpp's AMX kernels segfault on some Intel CPUs, for one) is an error here that names the library
and the signal, never the death of the benchmark or of the test run that drives it.

The child is started with "spawn" (a fresh interpreter: nothing of this process's threads or native state is
copied), builds the object from an importable factory, then answers method calls over a pipe until closed.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import traceback
from collections.abc import Callable


class Crashed(RuntimeError):
    """The child process died (a signal, or an exit) before it answered."""


def proc_stat(pid: int | str) -> list[str] | None:
    """A process's /proc/PID/stat fields after its command name (state, ppid, pgrp, ..., utime at 11, stime at 12),
    or None once it is gone (Linux)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except OSError:
        return None


def cpu_seconds(fields: list[str] | None) -> float:
    """User + system CPU seconds in a proc_stat() reading (0 for a process that is gone)."""
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def exit_reason(exitcode: int | None) -> str:
    """How a child process ended, in words: "SIGSEGV (signal 11)", "exit code 3", "no exit status"."""
    if exitcode is None:
        return "no exit status"
    if exitcode < 0:
        try:
            return f"{signal.Signals(-exitcode).name} (signal {-exitcode})"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def _serve(conn, factory: Callable, args: tuple, kwargs: dict) -> None:
    """The child's loop: build the object, then answer (method, args) calls until the pipe closes."""
    try:
        held = factory(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - sent back to the parent, which raises it
        conn.send((False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    conn.send((True, None))
    while True:
        try:
            method, call_args = conn.recv()
        except EOFError:
            return
        try:
            conn.send((True, getattr(held, method)(*call_args)))
        except Exception as exc:  # noqa: BLE001 - sent back to the parent, which raises it
            conn.send((False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class Child:
    """`factory(*args, **kwargs)` built in a child process; `child.call(method, *args)` runs one of its methods there
    and returns the result. A crash of the child raises Crashed naming `library` and how the child ended."""

    def __init__(self, library: str, factory: Callable, *args, **kwargs):
        context = multiprocessing.get_context("spawn")
        self.library = library
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(theirs, factory, args, kwargs), daemon=True)
        self.process.start()
        theirs.close()
        self._answer()

    def _crashed(self) -> Crashed:
        """What the child's death is raised as, once it has ended: the library and how it ended."""
        self.process.join(timeout=30)
        return Crashed(f"{self.library} died in its child process: {exit_reason(self.process.exitcode)}")

    def _answer(self):
        """The child's next reply: its value, its error raised here, or Crashed when it died instead."""
        try:
            ok, value = self.conn.recv()
        except (EOFError, ConnectionResetError):
            raise self._crashed() from None
        if not ok:
            raise RuntimeError(f"{self.library} failed in its child process: {value}")
        return value

    def call(self, method: str, *args):
        """Run `method(*args)` on the object in the child; its result."""
        try:
            self.conn.send((method, args))
        except (BrokenPipeError, ConnectionResetError):
            raise self._crashed() from None
        return self._answer()

    def cpu_seconds(self) -> float:
        """User + system CPU seconds the child has used so far."""
        return cpu_seconds(proc_stat(self.process.pid))

    def close(self) -> None:
        """End the child: close its pipe, then wait for it (killed if it does not end)."""
        self.conn.close()
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class Local:
    """The same calls as Child's on an object in this process (a fabricated library in tests); no CPU of its own."""

    def __init__(self, held):
        self.held = held

    def call(self, method: str, *args):
        """Run `method(*args)` on the object; its result."""
        return getattr(self.held, method)(*args)

    def cpu_seconds(self) -> float:
        """No process of its own: its CPU time is this process's."""
        return 0.0
