"""Signals and child processes: a remat command that is interrupted or terminated leaves nothing behind.

See NOTE [ Signals and children ]. No torch import.

Example::

    with signals_raise():
        rc = run_child([sys.executable, "-m", "planner.profiling.capped", ...])   # ended with remat
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Collection, Iterator, Sequence
from typing import Any

from planner.errors import Terminated

# NOTE [ Signals and children ]
#
# Rule 1. While a command runs, SIGINT raises KeyboardInterrupt (Python's default) and SIGTERM
#   raises ``Terminated`` (a KeyboardInterrupt), so every ``finally`` on the way out runs: temporary
#   files are removed (``planner.files.atomic_write``, ``tempfile.TemporaryDirectory``) and children
#   are ended. A second SIGTERM during that cleanup is ignored.
# Rule 2. The command then exits 130 after SIGINT and 143 after SIGTERM (128 + the signal number,
#   as a shell reports them), with one line (NOTE [ CLI errors and exit codes ]).
# Rule 3. A child process (the capped profiling child, ``remat verify``'s ranks) dies with remat:
#   the parent ends (SIGTERM, then SIGKILL after ``GRACE_S``) and reaps it on every exit path, and
#   the child asks the kernel for SIGKILL when its parent dies (PR_SET_PDEATHSIG on Linux), which
#   covers a parent killed with SIGKILL, whose ``finally`` never runs.
# Rule 4. SIGHUP (the terminal closed, the ssh session dropped) is SIGTERM's twin: raised as
#   ``Terminated``, exit 129, "hung up". Unless it was ignored when remat started (``nohup remat``):
#   then it stays ignored and the command runs on, as nohup promises.
# Rule 5. SIGKILL runs no ``finally``: the temporary folder of a killed command stays. Each folder a
#   command shares with its children is named ``remat-KIND-PID-...`` (``temp_dir``), and the next
#   command that makes one removes those of this user whose PID no longer runs. Why: ``kill -9`` of
#   ``remat plan --device-memory`` left /tmp/remat-capped-* for good (round 17 probe; the child died).
# Rule 6. A process the model's code forks (a multiprocessing ``Process``, a DataLoader worker) inherits these
#   handlers; there SIGTERM and SIGHUP do what they would without remat (the process dies of the signal), not
#   raise remat's ``Terminated``, which printed a traceback from the child (round 18 probe).
# Rule 7. A process the model's code starts and leaves running (a ``subprocess.Popen`` never waited for, an
#   ``os.fork``, a server started at import), of any kind, does not outlive remat: when the command is over and
#   Python's own exit handlers have run (a library's pool, wandb's service, multiprocessing end theirs there),
#   remat's live children that are not its own get ``GRACE_S``'s share left by the threads, are named in one note,
#   and are ended with what they started (SIGTERM, then SIGKILL), as remat's own children are (Rule 3).
#   ``left_children`` and ``end_tree``; ``planner/cli/main.py`` calls them. Linux only (it reads /proc). A process
#   that left its parent (a double fork, ``sh -c "server &"``: the shell exits at once) would be adopted by PID 1
#   and escape that list: remat's command asks the kernel to adopt such orphans of its descendants instead
#   (``adopt_orphans``, PR_SET_CHILD_SUBREAPER), so they are its children when it exits. multiprocessing's resource
#   tracker and fork server are not the model's: they end when remat does, and are left to do so.
#   SIGINT, SIGTERM or SIGHUP during their grace cuts it short (``wait_children``): by Python's default it ended remat
#   and they ran on (round 19 probe, exit 143, no line).
#   Why: `subprocess.Popen([python, "-c", "time.sleep(300)"])` at import ran on under PID 1 after
#   `remat plan` exited 0 (round 18 and 19 probes); `python model.py` leaves it too, but remat is not the
#   user's program: a planning command should leave nothing behind.
# Rule 8. Ctrl-C at a terminal signals the whole foreground process group, remat's children with it. A child remat
#   started (the capped profiling child) dies of SIGINT without a word (``quiet_on_ctrl_c``: the signal's default
#   action, not Python's KeyboardInterrupt), and remat, which got it too, says the one line (Rule 2); what the child
#   wrote is in remat's temporary folder, which remat removes. A SIGINT ignored when the child started (remat run
#   in the background) stays ignored. Why: the capped child printed a 110-line KeyboardInterrupt traceback from
#   wherever it was (importing torch) above remat's "interrupted: nothing was written" (round 25 probe).
# Why: SIGTERM during ``remat plan --device-memory`` used to kill remat at once, leaving the capped
# child running for 90 s under PID 1 and its temporary profile on disk; SIGHUP still did so after
# SIGTERM was caught (exit 129, no line, /tmp/remat-capped-* left behind).

HANGUP = tuple(s for s in (getattr(signal, "SIGHUP", None),) if s is not None)
"""SIGHUP where the platform has it (Rule 4)."""

GRACE_S = 5.0
"""Seconds a child gets to exit after SIGTERM before it is killed."""

PARENT_ENV = "REMAT_PARENT_PID"
"""Environment variable naming the parent's pid, for ``die_with_parent`` in the child."""


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Rule 1 for the duration of a command (main thread only; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum: int, _frame: Any) -> None:
        if os.getpid() != pid:  # Rule 6: a forked child of the model's code dies of the signal, as it would
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)  # cleanup runs once
        raise Terminated(f"terminated by signal {signum}", signum)

    pid = os.getpid()
    caught = [signal.SIGTERM] + [s for s in HANGUP if signal.getsignal(s) is not signal.SIG_IGN]  # Rule 4
    previous = {sig: signal.signal(sig, terminated) for sig in caught}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def temp_dir(kind: str) -> Iterator[str]:
    """A temporary folder ``remat-KIND-PID-...`` removed on every exit path; those left by killed remat
    processes are removed first (Rule 5)."""
    _remove_orphaned(kind)
    with tempfile.TemporaryDirectory(prefix=f"remat-{kind}-{os.getpid()}-") as tmp:
        yield tmp


def _remove_orphaned(kind: str) -> None:
    """Remove this user's ``remat-KIND-PID-*`` folders whose PID no longer runs (Rule 5)."""
    root, named = tempfile.gettempdir(), re.compile(rf"remat-{re.escape(kind)}-(\d+)-")
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            match = named.match(entry.name)
            if match and entry.is_dir(follow_symlinks=False) and entry.stat().st_uid == os.getuid() \
                    and not _runs(int(match.group(1))):
                shutil.rmtree(entry.path, ignore_errors=True)


def _runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process: it runs
    return True


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the parent's pid for ``die_with_parent``."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def die_with_parent() -> None:
    """In a child: ask for SIGKILL when the parent dies (Linux), and exit now if it already has."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    expected = os.environ.get(PARENT_ENV)
    if expected and expected.isdigit() and os.getppid() != int(expected):
        os._exit(1)  # the parent died before the request above: nobody waits for this child


def quiet_on_ctrl_c() -> None:
    """In a child remat started: SIGINT ends it by the signal's default action, with no traceback (Rule 8); an
    ignored SIGINT stays ignored."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_child(cmd: Sequence[str], *, env: dict[str, str] | None = None) -> int:
    """Run ``cmd`` and return its exit status; ended and reaped on every exit path (Rule 3)."""
    proc = subprocess.Popen(list(cmd), env=child_env(env), stdin=subprocess.DEVNULL)
    try:
        return proc.wait()
    finally:
        end(proc)


def how_it_ended(rc: int) -> str:
    """A child's exit status ``rc`` (``Popen.returncode``) in words: 'exited with status 7', or for a
    negative status 'was killed by SIGKILL (signal 9)'."""
    if rc >= 0:
        return f"exited with status {rc}"
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = "a signal"
    return f"was killed by {name} (signal {-rc})"


def end(proc: Any) -> None:
    """End ``proc`` (a ``subprocess.Popen`` or ``multiprocessing.Process``) if it still runs, and reap it."""
    alive = proc.poll() is None if hasattr(proc, "poll") else proc.is_alive()
    if not alive:
        _reap(proc)
        return
    with contextlib.suppress(ProcessLookupError, OSError):
        proc.terminate()
    if not _reap(proc, GRACE_S):
        with contextlib.suppress(ProcessLookupError, OSError):
            proc.kill()
        _reap(proc, GRACE_S)


def _reap(proc: Any, timeout: float | None = 0) -> bool:
    """Wait for ``proc`` up to ``timeout`` seconds; whether it has exited."""
    if hasattr(proc, "poll"):
        try:
            proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    proc.join(timeout)
    return not proc.is_alive()


def adopt_orphans() -> None:
    """Rule 7: orphaned descendants of this process become its children, not PID 1's (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER


def left_children(skip: Collection[int] = ()) -> dict[int, str]:
    """Rule 7: this process's live children (not zombies) but ``skip``, as pid -> command line; {} off Linux."""
    return {pid: command for pid, (ppid, command) in _processes().items() if ppid == os.getpid() and pid not in skip}


def end_tree(pids: Collection[int], grace_s: float = GRACE_S) -> None:
    """Rule 7: end ``pids`` (this process's children) and every process below them: SIGTERM, then SIGKILL after
    ``grace_s``; the children are reaped."""
    table = _processes()
    tree = list(pids)
    for pid in tree:  # grows as it goes: a breadth-first walk, no recursion
        tree.extend(p for p, (ppid, _) in table.items() if ppid == pid and p not in tree)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in tree:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        if _gone(tree, pids, grace_s):
            return


def wait_children(pids: Collection[int], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for this process's children ``pids`` to exit on their own; reap those that do. A
    SIGINT, SIGTERM or SIGHUP meanwhile ends the wait at once (Rule 7): it ended remat, and they ran on."""
    hurried: list[int] = []
    main = threading.current_thread() is threading.main_thread()
    caught = [s for s in (signal.SIGINT, signal.SIGTERM, *HANGUP) if main and signal.getsignal(s) is not signal.SIG_IGN]
    previous = {sig: signal.signal(sig, lambda signum, _frame: hurried.append(signum)) for sig in caught}
    try:
        _gone(list(pids), pids, timeout_s, stop=lambda: bool(hurried))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _gone(tree: list[int], children: Collection[int], timeout_s: float, stop: Any = lambda: False) -> bool:
    """Reap ``children`` and wait up to ``timeout_s`` (or until ``stop()``) until no process in ``tree`` runs;
    whether none does."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        for pid in children:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
        running = set(_processes())
        if not any(pid in running for pid in tree):
            return True
        if time.monotonic() >= deadline or stop():
            return False
        time.sleep(0.02)


def _processes() -> dict[int, tuple[int, str]]:
    """Every live process (zombies left out) as pid -> (parent pid, command line), from /proc; {} without it."""
    out: dict[int, tuple[int, str]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()  # after the name, which may hold spaces
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    command = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
            except OSError:  # it ended while read
                continue
            if fields[0] not in (b"Z", b"X"):
                out[int(entry.name)] = (int(fields[1]), command)
    return out


__all__ = ["adopt_orphans", "child_env", "die_with_parent", "end", "end_tree", "GRACE_S", "how_it_ended", "left_children",
           "PARENT_ENV", "quiet_on_ctrl_c", "run_child", "signals_raise", "temp_dir", "wait_children"]
