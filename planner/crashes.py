"""Ways out of remat's process that skip Python's: ``os._exit`` and a fatal signal in the model file's code.

See NOTE [ Exits that skip remat ]. No torch import; run as a script, this file is the watcher of Rule 2.

Example::

    with exits_said():   # the CLI runs each command inside
        run_the_command()
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Iterator
from types import FrameType
from typing import NoReturn

# NOTE [ Exits that skip remat ]
#
# remat runs the model file's code in its own process, so two ways out of a Python program skip every
# handler remat has: ``os._exit(n)`` and a fatal signal (a segmentation fault in ctypes or a C extension).
# Round 17 probe: both ended remat with status n (139) and no line; a temporary file would stay.
# Rule 1. While a command runs, ``os._exit`` called in remat's process and main thread raises ``CalledExit``,
#   a SystemExit, so it meets the handlers of the model file's ``sys.exit``: one line naming the call and
#   where it was made (``build_model() in model.py called os._exit(3) at model.py:4 in build_model``), exit 2,
#   every ``finally`` run (temporary files removed, children ended). In a forked child (a DataLoader worker,
#   a multiprocessing pool: another pid) it is the real one, which multiprocessing ends its children with. In
#   another thread of remat's process the line is said and the process ends with the status asked for, as
#   ``os._exit`` promises (only the main thread can end the command).
# Rule 2. A fatal signal cannot be survived. faulthandler writes the crashed thread's stack to a pipe; a small
#   watcher process (this file as a script) reads it and, when the pipe closes with a stack in it and without
#   remat's "done" mark, says one line naming the innermost frame outside Python, torch and remat (the
#   model's), and the innermost frame when that differs. The exit status stays the signal's (139 for SIGSEGV),
#   as the shell reports it. The watcher ends when remat ends, whichever way: the pipe closes.
# Rule 3. When faulthandler is on already (``python -X faulthandler``, PYTHONFAULTHANDLER=1, pytest), its full
#   dump is what the user asked for: remat leaves it and starts no watcher.
# Rule 4. The watcher runs in a session of its own and ignores SIGINT: Ctrl-C at the terminal goes to the whole
#   foreground process group, and the watcher, blocked reading its pipe, printed a KeyboardInterrupt traceback
#   under remat's "interrupted" line (round 18, found by test_ctrl_c_at_the_terminal_is_one_line).

DONE = b"\0remat-done\n"
"""Written to the watcher's pipe when the command ended in Python's way: whatever came before is a forked
child's crash, which remat reports itself."""

WATCHER_WAIT_S = 1.0
"""Seconds remat waits for the watcher to see its pipe close (a forked child still holding it makes it later)."""


class CalledExit(SystemExit):
    """The model's code called ``os._exit(status)`` (Rule 1). ``call``: ``os._exit(3) at model.py:4 in f``."""

    def __init__(self, status: int, call: str):
        super().__init__(status)
        self.call = call


# NOTE [ Settings the model file changes ]
#
# The model file runs in remat's process, so a process-wide setting it changes holds for remat's own code too.
# remat does not undo the user's setting (it may be meant); when remat's code fails under one, the line names it.
# Rule 1. ``sys.setrecursionlimit(50)``: remat's own frames (the CLI, the profiler, torch's dispatch) sit below the
#   model's; remat failed importing its profiler, "internal error: RecursionError" (round 17 probe). A RecursionError
#   while the limit is below the one the command started with, raised anywhere (remat's code, or the model's,
#   wrapped), is one line naming the limit and the fix, exit 2.
# Rule 2. ``torch.set_default_device("cuda")``: remat's own tensors are made there too; on a machine without CUDA
#   "internal error: AssertionError: Torch not compiled with CUDA enabled" (round 18 probe, set in
#   ``example_inputs``). A failure in remat's code (not a RematError) while torch's default device is meta or a
#   device this machine cannot use is one line naming the setting and the failure, exit 2. A usable GPU as the
#   default is left alone (an out-of-memory there is what it says). Round 19 read the path remat runs then (no GPU
#   to run it): every profile's host-link probe made its pinned buffer on the default device, which torch refuses
#   for a GPU ("Only dense CPU tensors can be pinned"), as did the offload store; both make host buffers on the CPU
#   by name now (Rule 5 of NOTE [ Offloaded units ]).
# Rule 3. ``os.umask(0o777)``: remat's new output files get the umask remat started with, the shell's, not the
#   model's (``planner.files.UMASK_FOR_FILES``; NOTE [ Writing output files ], Rule 3); the plan was written
#   ``----------`` (round 18 probe). The model's own files keep its umask: remat does not reset it.


@contextlib.contextmanager
def exits_said() -> Iterator[None]:
    """NOTE [ Exits that skip remat ] (main thread only; elsewhere nothing changes) and NOTE [ Settings the model
    file changes ] for the duration of a command."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from planner.errors import BadInput, ProfileError
    from planner.files import UMASK_FOR_FILES, process_umask

    limit, umask = sys.getrecursionlimit(), UMASK_FOR_FILES.set(process_umask())  # Rule 3
    try:
        with _os_exit_raises(), _crash_watch():
            yield
    except CalledExit as e:  # an os._exit that no boundary of the model's code caught
        raise ProfileError(f"the model's code called {e.call}; return a value or raise an exception instead") from None
    except Exception as e:
        changed = _changed_setting(e, limit)
        if changed is None:
            raise
        raise BadInput(changed) from e
    finally:
        UMASK_FOR_FILES.reset(umask)


def _changed_setting(e: Exception, limit: int) -> str | None:
    """The line of NOTE [ Settings the model file changes ] for ``e``, or None."""
    if sys.getrecursionlimit() < limit and _recursion_in(e):
        return (f"Python's recursion limit is {sys.getrecursionlimit()}, lowered from {limit} by the model file or a "
                f"library it imports (sys.setrecursionlimit), and remat ran out of it (RecursionError): remat and "
                f"torch call the model deeper than a training script does; raise the limit to at least {limit}, or "
                f"remove the call")
    from planner.errors import RematError

    if (deep := _deep(e)) is not None:
        return deep
    device = _default_device()
    if device is None or isinstance(e, RematError):
        return None
    text = (str(e).strip().splitlines() or [""])[0]
    return (f"the model's code set torch's default device to {device} (torch.set_default_device), and "
            f"remat's own tensors follow it: {type(e).__name__}: {text}; remove the call (build the model and the "
            f"batch with device=... instead; remat moves them to --device)")


# NOTE [ Models nested deep ]
#
# Each level of nested modules costs Python frames: 4 counted against the recursion limit a level in a plain
# training step (``_wrapped_call_impl``, ``_call_impl``, ``forward`` and the C call between), 5 when the module has
# hooks (torch adds ``inner``), and torch's ``named_modules`` recurses once a level. A chain of ``nn.Sequential``
# trains in plain Python under the default limit of 1000 up to 248 levels (round 19 probe).
# Rule 1. While remat runs the model's code (``user_code`` in ``planner/profiling/measure.py``), the recursion limit
#   is raised by a quarter, for the frame its hooks add a level, and by ``ROOM_FRAMES`` for its own frames below the
#   model's; it is put back afterwards unless the model's code set another meanwhile. Before, `remat plan` ran out
#   at 191 levels where the plain step ran 248: "the model's forward raised RecursionError" for a model that trains.
# Rule 2. A RecursionError the model's code raised says how deep its modules were nested where it ran out (the
#   module calls in its traceback) and the fix: raise the limit in the model file, or nest less.
# Rule 3. A RecursionError elsewhere while the limit is not lowered (torch's ``named_modules`` on the built model,
#   1,200 nested ``nn.Sequential``: "internal error: RecursionError") is one line naming the function that recursed
#   and how often, and the same fix, exit 2. A model nested that deep fails in ``python model.py`` too.
# Rule 4. remat's own walk over the unit tree (``_default_cut`` in ``planner/model/graph.py``, recursive, two frames
#   a level, before round 19) is a loop; the ILP's nested candidates are as deep as --granularity allows (256).

ROOM_FRAMES = 200
"""Frames the recursion limit is raised by for remat's own, below the model's code (Rule 1); the CLI and the profiler
hold about 40 under the model's forward, the hooks about 15 more at its deepest call."""


@contextlib.contextmanager
def recursion_room() -> Iterator[None]:
    """Rule 1 of NOTE [ Models nested deep ] for the duration of a call into the model's code."""
    limit = sys.getrecursionlimit()
    roomy = limit + limit // 4 + ROOM_FRAMES
    sys.setrecursionlimit(roomy)
    try:
        yield
    finally:
        if sys.getrecursionlimit() == roomy:  # the model's code set none of its own meanwhile
            sys.setrecursionlimit(limit)


def recursion_said(e: BaseException) -> str:
    """Rule 2 of NOTE [ Models nested deep ]: '' unless ``e`` is a RecursionError; then what to do about it."""
    if not isinstance(e, RecursionError):
        return ""
    import traceback

    calls = sum(f.name == "_call_impl" for f in traceback.extract_tb(e.__traceback__))
    nested = f", with modules nested {calls} deep where it ran out" if calls > 1 else ""
    return (f" (Python's recursion limit is {sys.getrecursionlimit()}{nested}: raise it in the model file "
            f"(sys.setrecursionlimit) if the model is meant to nest this deep, or nest less)")


def _deep(e: Exception) -> str | None:
    """Rule 3 of NOTE [ Models nested deep ]: the line for a RecursionError outside the model's code, or None."""
    from planner.errors import RematError

    if isinstance(e, RematError) or not _recursion_in(e):
        return None
    import collections
    import traceback

    while not isinstance(e, RecursionError):
        e = e.__cause__ or e.__context__
    frames = traceback.extract_tb(e.__traceback__)
    counts = collections.Counter((f.filename, f.name) for f in frames)
    (filename, name), times = counts.most_common(1)[0] if counts else (("an unknown place", "?"), 0)
    return (f"Python's recursion limit of {sys.getrecursionlimit()} ran out (RecursionError) in {name} "
            f"({filename}), which called itself {times} times: the model nests its modules deeper than this limit "
            f"lets torch walk and run them; raise it in the model file (sys.setrecursionlimit) if the model is meant "
            f"to nest this deep, or nest less")


def _default_device() -> str | None:
    """torch's default device in words when remat's own tensors cannot work there (Rule 2: meta, or a device this
    machine lacks), else None; no torch import. A usable GPU as the default is left alone: a failure there (an
    out-of-memory) is what it says."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "get_default_device"):
        return None
    try:
        device = torch.get_default_device()
    except Exception:  # noqa: BLE001 -- it probes with a tensor, which fails where the device cannot be used
        return "a device this machine cannot use"
    return repr(str(device)) if device.type == "meta" else None


def _recursion_in(e: BaseException | None) -> bool:
    """A RecursionError is ``e`` or caused it."""
    seen = 0
    while e is not None and seen < 20:
        if isinstance(e, RecursionError):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def _where(frame: FrameType | None) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}" if frame else "an unknown place"


@contextlib.contextmanager
def _os_exit_raises() -> Iterator[None]:
    """Rule 1."""
    real, pid, main = os._exit, os.getpid(), threading.main_thread()

    def _exit(status: int) -> NoReturn:
        if os.getpid() != pid:
            real(status)
        call = f"os._exit({status!r}) at {_where(sys._getframe(1))}"
        if threading.current_thread() is not main:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                print(f"error: a thread of the model's code called {call}; remat ends with status {status}, as "
                      f"os._exit asks, and nothing was written", file=sys.stderr, flush=True)
            real(status)
        raise CalledExit(status, call)

    os._exit = _exit
    try:
        yield
    finally:
        os._exit = real


@contextlib.contextmanager
def _crash_watch() -> Iterator[None]:
    """Rules 2 and 3."""
    if faulthandler.is_enabled():
        yield
        return
    read_fd, write_fd = os.pipe()
    try:
        watcher = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), json.dumps(_library())],
                                   stdin=read_fd, stdout=subprocess.DEVNULL, start_new_session=True)  # Rule 4
    except OSError:  # no process to spare: remat runs on without the line
        os.close(read_fd), os.close(write_fd)
        yield
        return
    os.close(read_fd)
    faulthandler.enable(file=write_fd, all_threads=False)
    try:
        yield
    finally:
        faulthandler.disable()
        with contextlib.suppress(OSError):
            os.write(write_fd, DONE)
        os.close(write_fd)
        with contextlib.suppress(subprocess.TimeoutExpired):
            watcher.wait(WATCHER_WAIT_S)


def is_watcher(command: str) -> bool:
    """Whether a process's command line is remat's crash watcher (Rule 2), a child of remat's own."""
    return os.path.abspath(__file__) in command


def _library() -> dict[str, list[str]]:
    """Folders whose frames are not the model's: Python's own (less site-packages), torch's, remat's, the CLI's."""
    paths = sysconfig.get_paths()
    skip = [paths["stdlib"], paths["platstdlib"]]
    for name in ("torch", "planner", "solvers", "typer", "click", "rich"):
        with contextlib.suppress(ImportError, ValueError):
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.origin:
                skip.append(os.path.dirname(spec.origin))
    keep = [paths["purelib"], paths["platlib"]]
    return {"skip": [os.path.realpath(p) + os.sep for p in skip], "keep": [os.path.realpath(p) + os.sep for p in keep]}


# ----------------------------------------------------------------------------- the watcher (Rule 2)

_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def crash_line(dump: str, library: dict[str, list[str]]) -> str | None:
    """The one line for faulthandler's ``dump``, or None when it holds no crash."""
    head = re.search(r"Fatal Python error: ([^\n]+)", dump)
    if head is None:
        return None
    frames = [m.groups() for m in map(_FRAME.match, dump.splitlines()) if m]
    mine = [f for f in frames if not _is_library(f[0], library)]
    where = f" at {_frame(mine[0])}" if mine else ""
    if frames and (not mine or frames[0] != mine[0]):
        where += f" (innermost: {_frame(frames[0])})"
    return (f"error: remat's process crashed with a fatal signal, {head.group(1).lower()},{where}: the model's code, "
            f"or a library it calls, runs in remat's process; nothing was written. For the whole stack, rerun with "
            f"PYTHONFAULTHANDLER=1")


def _frame(frame: tuple[str, str, str]) -> str:
    return f"{frame[0]}:{frame[1]} in {frame[2]}"


def _is_library(filename: str, library: dict[str, list[str]]) -> bool:
    """The longest folder that holds ``filename`` decides: torch's own folder inside site-packages is library,
    a Hugging Face model in site-packages (inside the stdlib folder on a system Python) is the model's."""
    if filename.startswith("<"):
        return True
    path = os.path.realpath(filename)
    holders = [(len(d), kind == "skip") for kind in ("skip", "keep") for d in library[kind] if path.startswith(d)]
    return max(holders)[1] if holders else False


def _watch(library: dict[str, list[str]]) -> None:
    """Read the pipe to its end; say the crash unless remat marked its end as its own (Rule 2)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Rule 4
    dump = sys.stdin.buffer.read()
    if dump.endswith(DONE):
        return
    line = crash_line(dump.decode("utf-8", "replace"), library)
    if line:
        print(line, file=sys.stderr, flush=True)


__all__ = ["CalledExit", "crash_line", "DONE", "exits_said", "is_watcher", "recursion_room", "recursion_said", "ROOM_FRAMES",
           "WATCHER_WAIT_S"]


if __name__ == "__main__":
    _watch(json.loads(sys.argv[1]))
