"""Writing files the user names (``-o``, ``--plot``): one helper for every writer.

See NOTE [ Writing output files ]. None of this imports torch.

Example::

    atomic_write_text("plan.json", plan.to_json())   # readers see the old file or the new one
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

from planner.errors import BadInput, WriteFailed

# NOTE [ Writing output files ]
#
# Every file remat writes for the user (plans, profiles, the frontier's JSON and PNG) goes
# through ``atomic_write``, which writes as ``cp`` and editors do:
#
# Rule 1. A symlink is followed: its target is written (created if the link dangles) and the
#   link stays a link. Why: replacing the link would silently detach whatever else reads it.
# Rule 2. A path that exists and is not a regular file (a directory, a device such as /dev/full,
#   a FIFO, a socket) is refused with one line, before any profiling. Why: as root, a rename over
#   /dev/full turned the device into a regular file.
# Rule 3. Modes: an existing file keeps its mode (and, for root, its owner and group); a new file
#   gets what the umask gives, 0666 & ~umask, as ``open(path, "w")`` would. Why: ``mkstemp``
#   creates 0600, which made plans unreadable to the group that trains with them. While a CLI command runs,
#   the umask is the one remat started with (``UMASK_FOR_FILES``), the shell's: a model file's ``os.umask(0o777)``
#   made the plan ``----------`` (round 18 probe; NOTE [ Settings the model file changes ], Rule 3).
# Rule 4. The bytes go to a temp file in the target's folder (same filesystem), are fsynced and
#   renamed over the target: a reader sees the old file or the new one, never half of one. The
#   temp file is removed on every exit path, an exception or a signal that raises included
#   (SIGINT and SIGTERM raise in remat, see NOTE [ Signals and children ] in planner/children.py).
# Rule 5. An output that is one of the command's inputs (the model file, the profile read by
#   --profile, the --hf config, the other output of the same command), through any link or hard
#   link, is refused with one line before anything runs. Why: `remat plan --profile p.json -o p.json`
#   replaced the profile with the plan, and `remat plan model.py -o model.py` the user's model source.
# Rule 6. A write that fails part way (the disk or the quota full, a file size limit, an I/O error) is
#   one line naming the cause and the fix (``WriteFailed``, a BadInput that is still an OSError),
#   never an internal error; by Rule 4 the target is as it was. Why: a 29 KB profile onto a full disk ended as "internal error: OSError: [Errno 28]
#   No space left on device", under `ulimit -f` as "[Errno 27] File too large".
# Rule 7. An output given as '-' or with a trailing separator ('out/') is refused with one line.
#   Why: `-o -` wrote a file named '-' in the working folder, and `-o newdir/` a file named
#   'newdir' (pathlib drops the slash), where the user meant stdout or a folder.


def as_path(value: object, expected: str) -> Path:
    """``value`` (a str or ``os.PathLike``) as a ``Path``; ``BadInput`` saying what was ``expected`` otherwise."""
    if isinstance(value, (str, os.PathLike)) and not isinstance(value, bytes):
        return Path(value)
    raise BadInput(f"expected {expected} (a str or os.PathLike), got {type(value).__name__}")


# NOTE [ Paths are the user's, not the model file's ]
#
# Every path given on the command line (outputs, model, plan, profile, config) is made absolute when
# the options are parsed (``planner.cli.options.Options``), against the directory the command was
# started in, before any user code runs: a model file may change the working directory (os.chdir at
# import, in build_model or forward), and a relative ``-o plan.json`` then wrote /plan.json (round 17
# probe), or ``remat verify``'s relative PLAN.json was looked for there. Links are kept, not resolved
# (Rule 1 above follows them when writing). Messages name the absolute path.


def as_output(path: object, example: str = "out.json") -> Path:
    """``path`` as the ``Path`` of a file to write, or ``BadInput`` for '-' or a path ending in a separator (Rule 7;
    ``example``: a file name the message suggests)."""
    given = as_path(path, "the path of the file to write")
    text = os.fspath(path)
    if text == "-":
        raise BadInput("cannot write '-': remat writes its files by name, not to stdout; give a file name "
                       "(--json prints the result on stdout)")
    if text.endswith(("/", os.sep)):
        raise BadInput(f"cannot write {text}: it ends in '{text[-1]}', so it names a folder; give a file name such "
                       f"as {text}{example}")
    return given


def atomic_write(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` by NOTE [ Writing output files ]; returns ``path`` as given."""
    given = as_output(path)
    target = _target(given)
    mode, owner = _mode_for(target)
    fd, tmp = _temp_beside(given, target)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            if owner is not None:
                with contextlib.suppress(OSError):
                    os.fchown(f.fileno(), *owner)
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):  # Rule 6
            raise _not_written(given, target, e) from None
        raise
    return given


def _not_written(given: Path, target: Path, e: OSError) -> WriteFailed:
    """Rule 6: a write that failed (disk full, a file size limit, an I/O error) as one line; the target is as it was."""
    kept = "the file there is unchanged" if target.exists() else "nothing was written"
    fix = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some of your quota",
           errno.EFBIG: "raise the file size limit (ulimit -f)"}.get(e.errno, "check the device")
    return WriteFailed(f"cannot write {given}: {e.strerror or e} ({kept}); {fix}, or write elsewhere", e.errno)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """``atomic_write`` for text (UTF-8)."""
    return atomic_write(path, text)


def check_writable(path: str | Path) -> None:
    """Fail now, before minutes of profiling, when ``path`` could not be written later."""
    given = Path(path)
    fd, probe = _temp_beside(given, _target(given))
    os.close(fd)
    os.unlink(probe)


def check_output(path: str | Path | None, inputs: Mapping[str, str | Path | None],
                 outputs: Mapping[str, str | Path | None] | None = None) -> None:
    """Rule 5 and ``check_writable``: refuse, before any profiling, an output ``path`` that is one of
    ``inputs`` (what each is, e.g. "the model file", to the path given; None for one not given) or one of
    the command's other ``outputs`` (e.g. "the file -o writes")."""
    if path is None:
        return
    given = as_output(path)
    for what, source in (*inputs.items(), *(outputs or {}).items()):
        if source is not None and _same_file(given, Path(source)):
            why = " too" if what in (outputs or {}) else ", which this command reads; writing there would replace it"
            raise BadInput(f"cannot write {given}: it is {what}{why}; write to another file")
    check_writable(given)


def _same_file(a: Path, b: Path) -> bool:
    """Whether writing ``a`` would replace ``b`` (a folder ``b``: its config.json, as --hf reads it)."""
    if b.is_dir():
        b = b / "config.json"
    try:
        return os.path.samefile(a, b)  # links and hard links too
    except OSError:  # one of them does not exist (yet)
        return os.path.realpath(a) == os.path.realpath(b)


def _target(path: Path) -> Path:
    """The file a write to ``path`` lands in (symlinks followed), or BadInput when it is not a regular file."""
    target = Path(os.path.realpath(path))
    try:
        st = os.stat(target)
    except (FileNotFoundError, NotADirectoryError):
        return target  # a new file; _temp_beside words a missing or non-folder parent
    except OSError as e:
        raise BadInput(f"cannot write {path}: {e.strerror}; pick another path") from None
    if stat.S_ISDIR(st.st_mode):
        raise BadInput(f"cannot write {path}: it is a directory; give a file name such as {path / 'plan.json'}")
    if not stat.S_ISREG(st.st_mode):
        what = _kind(st.st_mode)
        via = f" (via the link to {target})" if target != path.absolute() else ""
        raise BadInput(f"cannot write {path}{via}: it is {what}, not a regular file; give a file path")
    return target


def device_kind(path: str | Path) -> str | None:
    """'a character device', 'a block device' or 'a socket' when ``path`` is one, else None: what an input
    file must not be. Reading /dev/zero or /dev/urandom as JSON never ends, and its memory grows with it;
    a FIFO is let through, as ``<(cat plan.json)`` is one."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return _kind(mode) if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISSOCK(mode) else None


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _mode_for(target: Path) -> tuple[int, tuple[int, int] | None]:
    """The mode the written file gets, and the (uid, gid) to keep when root replaces another's file."""
    try:
        st = os.stat(target)
    except (FileNotFoundError, NotADirectoryError):
        return 0o666 & ~_umask(), None
    keep_owner = hasattr(os, "geteuid") and os.geteuid() == 0 and (st.st_uid, st.st_gid) != (0, 0)
    return stat.S_IMODE(st.st_mode), ((st.st_uid, st.st_gid) if keep_owner else None)


UMASK_FOR_FILES: contextvars.ContextVar[int | None] = contextvars.ContextVar("remat_umask_for_files", default=None)
"""The umask new output files get (Rule 3): set by the CLI for a command to the umask remat started with; None
(Python callers): the process's umask when the file is written."""


def _umask() -> int:
    """The umask for a new file: ``UMASK_FOR_FILES`` when set, else the process's, read without changing it where
    the OS allows (Linux: /proc/self/status)."""
    fixed = UMASK_FOR_FILES.get()
    if fixed is not None:
        return fixed
    return process_umask()


def process_umask() -> int:
    """The process's umask now, read without changing it where the OS allows (Linux: /proc/self/status)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _temp_beside(given: Path, target: Path) -> tuple[int, str]:
    """A temp file in ``target``'s folder (same filesystem, so the rename is atomic), or BadInput."""
    parent = target.parent
    if not parent.exists():
        raise BadInput(f"cannot write {given}: folder {given.parent if given == target else parent} does not exist; "
                       f"create it or pick another path")
    if not parent.is_dir():
        raise BadInput(f"cannot write {given}: {parent} is a file, not a folder; pick another path")
    try:
        return tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=parent)
    except OSError as e:
        raise BadInput(f"cannot write {given}: {e.strerror}; pick a writable location") from None


__all__ = ["as_path", "atomic_write", "atomic_write_text", "check_output", "check_writable", "device_kind", "process_umask",
           "UMASK_FOR_FILES"]
