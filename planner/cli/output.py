"""Where the CLI's output goes: progress on stderr (``stages``, ``counter``) and JSON on stdout
(``json_text``, ``print_json``; NOTE [ JSON on stdout ]). ``render`` says what is shown. No torch import.

Example::

    with stages(log, "profiling model.py ...", total=7) as say:
        say("warm-up step 1/1")
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pydantic import BaseModel
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from planner.cli.render import plain
from planner.model.schema import Plan


# ----------------------------------------------------------------------------- progress


def _bar(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console)


@contextlib.contextmanager
def stages(console: Console, title: str, total: int) -> Iterator[Callable[[str], None]]:
    """Progress through ``total`` named stages; yields ``say(message)``, called as each one starts.

    On a terminal: one rich bar on ``console`` (stderr), its description the current stage.
    Elsewhere (a pipe, a CI log, ``--quiet``): ``title`` and each message as a plain line.
    """
    if not console.is_terminal or console.quiet:
        plain(console, title)
        yield lambda message: plain(console, message)
        return
    with _bar(console) as bar:
        task = bar.add_task(title, total=total)
        started = 0

        def say(message: str) -> None:
            nonlocal started
            started += 1
            if started > bar.tasks[0].total:
                bar.update(task, total=started)
            bar.update(task, completed=started - 1, description=f"{title} {message}")

        yield say
        bar.update(task, completed=bar.tasks[0].total, description=title)


@contextlib.contextmanager
def counter(console: Console, title: str) -> Iterator[Callable[[int, int], None]]:
    """Yields ``tick(done, total)``: a rich bar on a terminal, nothing elsewhere (say the result after)."""
    if not console.is_terminal or console.quiet:
        yield lambda done, total: None
        return
    with _bar(console) as bar:
        task = bar.add_task(title, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


# ----------------------------------------------------------------------------- a reader that stops early

# NOTE [ A reader that stops early ]
#
# Rule 1. When stdout's reader goes away (``remat show plan.json | head -1``, a pager quit), the rest of
#   stdout goes to /dev/null and the command runs to its end: its files are written (``-o``), its exit
#   code is its own, and nothing is said: the reader stopped on purpose, as ``head`` and ``less`` do.
# Rule 2. Every stream remat writes stdout through is wrapped: ``sys.stdout`` while ``main`` runs (rich's
#   consoles and the model file's prints use it) and ``print_json``'s copy of the real stdout.
# Rule 3. Any other failed write to stdout (``> /dev/full``, an I/O error) is handled the same way while the
#   command runs, and said at its end in one line, exit 2 (a 0 becomes 2): its files are written, what it
#   printed is lost.
# Rule 4. A standard stream closed when remat starts (``>&-``, ``2>&-``) is opened on /dev/null first:
#   Python's ``sys.stdout`` is then None (an AttributeError), and the next file remat opened would get
#   descriptor 1, where a child process's output would land.
# Rule 5. The model's code cannot close remat's standard streams: ``sys.stdout.close()`` or ``sys.stderr.close()``
#   in the model file flushes them and leaves them open, as closing a terminal's stream in a script would not
#   close the terminal. Round 18 probe: stdout closed at import was "internal error: ValueError: I/O operation on
#   closed file." (exit 1); stderr closed, then an error, printed Python's "lost sys.stderr" dump.
# Rule 6. Text the stream's encoding cannot hold is written with backslash escapes, not refused: a file name of
#   bytes that are not UTF-8 (b'o\xffut.json') is a str with a surrogate in Python, and a strict stream
#   (PYTHONIOENCODING=utf-8, an IDE's or a notebook's) raised UnicodeEncodeError at "wrote o\udcffut.json": the plan was
#   written, then "internal error: UnicodeEncodeError ... *** You may need to add PYTHONIOENCODING=utf-8 ..." (exit 1,
#   two lines; round 19 probe).
# Why: rich answered the broken pipe with SystemExit(1) mid-command, whose way out met
# ``click_errors.Abort``, a name this typer lacks: ~60 lines of traceback and an AttributeError
# (round 17: ``remat show plan.json | head -1`` and ``remat devices | head -2``); ``> /dev/full`` was an
# internal error and ``>&-`` an AttributeError, both before the plan was written.


class ReaderMayLeave:
    """``stream`` (a text file on a descriptor) whose writes, once its reader has gone or a write failed, go to
    /dev/null (NOTE [ A reader that stops early ]); ``failed``: the first error other than the reader leaving
    (Rule 3); anything else is the stream's."""

    def __init__(self, stream: Any):
        self._stream = stream
        self.failed: OSError | None = None

    def write(self, text: str) -> int:
        try:
            return _write_escaped(self._stream, text)
        except OSError as e:
            self._lost(e)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            self._lost(e)

    def _lost(self, e: OSError) -> None:
        if not isinstance(e, BrokenPipeError) and self.failed is None:
            self.failed = e
        with contextlib.suppress(AttributeError, OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)

    def close(self) -> None:
        """Rule 5: flushed, not closed."""
        self.flush()

    @property
    def closed(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class KeptOpen:
    """``stream`` whose ``close()`` only flushes (Rule 5 of NOTE [ A reader that stops early ]); anything else is
    the stream's."""

    def __init__(self, stream: Any):
        self._stream = stream

    def write(self, text: str) -> int:
        return _write_escaped(self._stream, text)  # Rule 6

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._stream.flush()

    @property
    def closed(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _write_escaped(stream: Any, text: str) -> int:
    """``stream.write(text)``, with what its encoding cannot hold backslash-escaped (Rule 6)."""
    try:
        return stream.write(text)
    except UnicodeEncodeError:
        encoding = getattr(stream, "encoding", None) or "utf-8"
        escaped = text.encode(encoding, "backslashreplace").decode(encoding)
        stream.write(re.sub(r"\\udc([89a-f][0-9a-f])", r"\\x\1", escaped))  # a name's byte 0xff as \xff, as written
        return len(text)


@contextlib.contextmanager
def reader_may_leave() -> Iterator[ReaderMayLeave]:
    """``sys.stdout`` wrapped in ``ReaderMayLeave`` for the duration (Rule 2), the standard streams open (Rule 4)."""
    real_out, real_err = sys.stdout, sys.stderr
    _standard_fds_open()
    sys.stdout = ReaderMayLeave(real_out if real_out is not None else open(os.devnull, "w"))
    sys.stderr = KeptOpen(real_err if real_err is not None else open(os.devnull, "w"))  # Rule 5
    try:
        yield sys.stdout
    finally:
        sys.stdout, sys.stderr = real_out, real_err


def _standard_fds_open() -> None:
    """Rule 4: a closed descriptor 0, 1 or 2 (``remat ... >&-``) is opened on /dev/null."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            devnull = os.open(os.devnull, os.O_RDWR)
            if devnull != fd:
                os.dup2(devnull, fd)
                os.close(devnull)


# ----------------------------------------------------------------------------- JSON


def json_text(obj: BaseModel | Sequence[BaseModel] | dict | list) -> str:
    """Machine-readable JSON (indent 2, trailing newline) for a model, a list of models or plain data."""
    if isinstance(obj, Plan):
        return obj.to_json()
    if isinstance(obj, BaseModel):
        return obj.model_dump_json(indent=2) + "\n"
    if isinstance(obj, (list, tuple)):
        obj = [o.model_dump(mode="json") if isinstance(o, BaseModel) else o for o in obj]
    return json.dumps(obj, indent=2, default=str) + "\n"


# NOTE [ JSON on stdout ]
#
# With --json, stdout is one JSON document and nothing else, whatever else runs: the model file's
# prints at import and in forward, a library's print, a child process (the capped profiling
# child, verify's ranks) writing to the stdout it inherits. While the command runs, ``json_stdout``
# points ``sys.stdout`` at stderr and, where stdout is a real file descriptor, fd 1 at stderr's
# too (a copy of the real stdout kept aside); ``print_json`` writes to that copy. Both are
# restored when the command ends, however it ends.

_json_out: Any = None
"""Where ``print_json`` writes while ``json_stdout`` is active: the real stdout."""


@contextlib.contextmanager
def json_stdout(active: bool = True) -> Iterator[None]:
    """NOTE [ JSON on stdout ]: everything but ``print_json`` goes to stderr while active."""
    global _json_out
    if not active:
        yield
        return
    real = sys.stdout
    real.flush()
    fds = _fds(real, sys.stderr)
    saved = os.dup(fds[0]) if fds else None
    if fds:
        os.dup2(fds[1], fds[0])
    _json_out = ReaderMayLeave(os.fdopen(os.dup(saved), "w", encoding="utf-8")) if saved is not None else real
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout = real
        _json_out.flush()
        if isinstance(real, ReaderMayLeave) and real.failed is None:  # NOTE [ A reader that stops early ], Rule 3
            real.failed = getattr(_json_out, "failed", None)
        if saved is not None:
            _json_out.close()
            sys.stderr.flush()
            os.dup2(saved, fds[0])
            os.close(saved)
        _json_out = None


def _fds(out: Any, err: Any) -> tuple[int, int] | None:
    """The file descriptors of ``out`` and ``err``, or None when either has none (a test's capture)."""
    try:
        return out.fileno(), err.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def print_json(obj: Any) -> None:
    """Write ``json_text(obj)`` to stdout (the real one under ``json_stdout``), bypassing rich so that
    nothing is wrapped or coloured."""
    stream = _json_out if _json_out is not None else sys.stdout
    stream.write(json_text(obj))
    stream.flush()


__all__ = ["counter", "json_stdout", "json_text", "KeptOpen", "print_json", "reader_may_leave", "ReaderMayLeave", "stages"]
