"""The ``remat`` command: typer's ``app`` with its usage errors in one line.

Example::

    $ remat plan --steps 0 model.py
    error: Invalid value for '--steps': Input should be greater than or equal to 1 (remat plan -h lists the options)
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
from collections.abc import Sequence
from typing import Any

import typer

from planner.cli.app import app
from planner.cli.output import reader_may_leave
from planner.errors import listed

try:  # typer 0.23 and later carry their own copy of click
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as click_errors


# NOTE [ Usage errors in one line ]
#
# typer prints a usage error (an unknown option, a value out of range) as a boxed block of five or
# six lines with the usage line above it. Every other bad input of remat is one line
# "error: ..." (NOTE [ CLI errors and exit codes ] in planner/cli/app.py), so the console script
# runs the app unattended (``standalone_mode=False``) and words click's error the same way, with
# the command's help named as the fix; exit 2 as click gives. ``remat`` alone still prints the help
# (exit 2).


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``remat`` (``argv`` or the command line) and exit with its code (NOTE [ Usage errors in one line ])."""
    from planner.children import adopt_orphans

    adopt_orphans()  # Rule 7 of NOTE [ Signals and children ]: a double fork of the model's code stays remat's
    atexit.register(_end_children)  # first registered, so it runs last (Rule 7 of NOTE [ Signals and children ])
    if "--debug" not in (sys.argv[1:] if argv is None else argv):
        sys.unraisablehook = _unraisable_line  # NOTE [ Exceptions Python can only report ]
    try:
        with reader_may_leave() as stdout:  # NOTE [ A reader that stops early ]
            code = app(args=list(argv) if argv is not None else None, prog_name="remat", standalone_mode=False)
            code = _stdout_lost(stdout, code)
    except click_errors.NoArgsIsHelpError:
        app(args=["--help"], prog_name="remat", standalone_mode=False)
        code = 2  # as click exits when it shows the help for want of a command
    except click_errors.ClickException as e:
        where = e.ctx.command_path if getattr(e, "ctx", None) is not None else "remat"
        print(f"error: {e.format_message()} ({where} -h lists the options)", file=sys.stderr)
        code = e.exit_code
    except typer.Abort:  # typer's own copy of click has no exceptions.Abort
        print("interrupted", file=sys.stderr)
        code = 130
    code = code if isinstance(code, int) else 0
    _leave_threads(code)
    sys.exit(code)


def _stdout_lost(stdout: Any, code: Any) -> Any:
    """NOTE [ A reader that stops early ], Rule 3: a failed write to stdout said at the end, exit 2."""
    if stdout.failed is None:
        return code
    print(f"error: cannot write to stdout: {stdout.failed.strerror or stdout.failed}; what remat printed there is "
          f"lost (its files are written)", file=sys.stderr)
    return code if isinstance(code, int) and code else 2


# NOTE [ Exceptions Python can only report ]
#
# An exception raised where no caller can catch it (an ``atexit`` callback of the model file, a ``__del__``, a
# weakref callback) goes to ``sys.unraisablehook``, whose default prints "Exception ignored in ..." and a
# traceback: a model file's atexit callback that raised printed six lines of traceback after remat's last line
# (round 18 probe, exit 0, the plan written). remat words it as one note on stderr naming the exception and its
# innermost frame; the exit status stays the command's (the work is done). ``--debug`` keeps Python's report.


def _unraisable_line(unraisable: Any) -> None:
    """NOTE [ Exceptions Python can only report ]."""
    import traceback

    frames = traceback.extract_tb(unraisable.exc_traceback) if unraisable.exc_traceback else []
    where = f" at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    what = (unraisable.err_msg or "Exception ignored in").rstrip(": ")
    owner = getattr(unraisable.object, "__qualname__", None) or type(unraisable.object).__name__
    text = (str(unraisable.exc_value).strip().splitlines() or [""])[0]
    with contextlib.suppress(OSError, ValueError, AttributeError):
        print(f"note: {what[:1].lower()}{what[1:]} {owner}: {unraisable.exc_type.__name__}: {text}{where} (remat's "
              f"result stands; --debug shows the traceback)", file=sys.stderr, flush=True)


# NOTE [ Threads the model file leaves running ]
#
# Python waits at exit for every thread that is not a daemon. A model file that starts one (a logger, a
# prefetcher, a watchdog) and never ends it made remat hang after its last line, its work done and its
# file written (round 17 probe: `threading.Thread(target=serve).start()` at import, killed after 120 s).
# Rule 1. When the command is over, such threads get ``THREAD_GRACE_S`` to finish; any still running
#   are named in one line on stderr and remat exits with the command's code without waiting for them
#   (``os._exit`` after flushing its streams: the atexit handlers of the model's libraries are skipped).
# Rule 2. A ``concurrent.futures`` pool's workers are not such threads: Python's shutdown ends them
#   (its own atexit hook), and skipping it could leave the pool's work, or a compile pool's children,
#   behind. torch.compile's inductor leaves two after ``remat plan --compile``.
# Rule 3. A ``multiprocessing`` process that is not a daemon is waited for too (multiprocessing's atexit hook
#   joins it): `Process(target=serve).start()` at import held remat 60 s after its last line (round 18 probe).
#   Such processes share the threads' grace; any still running are named in one line and ended (SIGTERM, then
#   SIGKILL, NOTE [ Signals and children ]), as Python's exit would have ended the threads. Daemon processes
#   (a ``Pool``'s workers) are left to multiprocessing, which ends them at exit.

THREAD_GRACE_S = 2.0
"""Seconds the model file's non-daemon threads get to finish once the command is over."""


def _leave_threads(code: int) -> None:
    """NOTE [ Threads the model file leaves running ]: exit now if a non-daemon thread would keep remat alive."""
    import os
    import time

    deadline = time.monotonic() + THREAD_GRACE_S
    for thread in _running():
        thread.join(max(0.0, deadline - time.monotonic()))
    _end_processes(deadline)
    left = _running()
    if not left:
        return
    names = listed([repr(t.name) for t in left], 3)
    print(f"note: {len(left)} thread(s) the model file or a library it uses started still run ({names}); remat exits "
          f"without waiting for "
          f"them (make them daemon threads, or join them, to end them yourself)", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    _end_children()  # os._exit skips the atexit handlers
    os._exit(code)


def _end_processes(deadline: float) -> None:
    """Rule 3 of NOTE [ Threads the model file leaves running ]: end the non-daemon processes Python would wait for."""
    import time

    from planner.children import end

    multiprocessing = sys.modules.get("multiprocessing")
    waited = [p for p in multiprocessing.active_children() if not p.daemon] if multiprocessing is not None else []
    for process in waited:
        process.join(max(0.0, deadline - time.monotonic()))
    left = [p for p in waited if p.is_alive()]
    if not left:
        return
    names = listed([f"{p.name!r} (pid {p.pid})" for p in left], 3)
    print(f"note: {len(left)} process(es) the model file or a library it uses started with multiprocessing still run "
          f"({names}), which Python would wait for at exit; remat ends them (make them daemon processes, or join "
          f"them, to end them yourself)", file=sys.stderr, flush=True)
    for process in left:
        end(process)


def _end_children() -> None:
    """Rule 7 of NOTE [ Signals and children ]: name and end the processes the model's code leaves running."""
    from planner.children import end_tree, left_children, wait_children
    from planner.crashes import is_watcher

    multiprocessing = sys.modules.get("multiprocessing")  # its processes are Rule 3's, or multiprocessing's
    theirs = {p.pid for p in multiprocessing.active_children()} if multiprocessing is not None else set()
    theirs |= _multiprocessing_helpers()
    left = [pid for pid, command in left_children(theirs).items() if not is_watcher(command)]
    if left:
        wait_children(left, THREAD_GRACE_S)
    running = left_children(theirs)
    left = [pid for pid in left if pid in running]
    if not left:
        return
    names = listed([f"pid {pid}: {_shortened(running[pid])!r}" for pid in left], 3)
    with contextlib.suppress(OSError, ValueError, AttributeError):
        print(f"note: {len(left)} process(es) the model file or a library it uses started still run ({names}), and "
              f"would outlive remat; remat ends them and what they started (wait for them in the model's code, or "
              f"end them, to end them yourself)", file=sys.stderr, flush=True)
    end_tree(left)


def _multiprocessing_helpers() -> set[int]:
    """multiprocessing's resource tracker and fork server: they end when remat does (their pipe closes), and killed
    first they leave the semaphores they track (a spawn context's Lock started one: named as the model's, round 19)."""
    pids = set()
    for module, owner, field in (("multiprocessing.resource_tracker", "_resource_tracker", "_pid"),
                                 ("multiprocessing.forkserver", "_forkserver", "_forkserver_pid")):
        pid = getattr(getattr(sys.modules.get(module), owner, None), field, None)
        if isinstance(pid, int):
            pids.add(pid)
    return pids


def _shortened(command: str, limit: int = 60) -> str:
    return command if len(command) <= limit else command[:limit - 3] + "..."


def _running() -> list[threading.Thread]:
    """Non-daemon threads that would hold the exit; not a ``concurrent.futures`` pool's workers, which
    Python's own shutdown ends (inductor compiles with such a pool: ``remat plan --compile`` leaves two)."""
    pools = sys.modules.get("concurrent.futures.thread")
    pooled = getattr(pools, "_threads_queues", {}) if pools is not None else {}
    return [t for t in threading.enumerate()
            if t.is_alive() and not t.daemon and t is not threading.main_thread() and t not in pooled]


__all__ = ["main"]

if __name__ == "__main__":
    main()
