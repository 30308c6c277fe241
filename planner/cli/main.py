"""The ``remat`` command: typer's ``app`` with its usage errors in one line.

Example::

    $ remat plan --steps 0 model.py
    error: Invalid value for '--steps': Input should be greater than or equal to 1 (remat plan -h lists the options)
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import typer

from planner.cli.app import app
from planner.cli.output import reader_may_leave

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
    try:
        with reader_may_leave():  # NOTE [ A reader that stops early ]
            code = app(args=list(argv) if argv is not None else None, prog_name="remat", standalone_mode=False)
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
    sys.exit(code if isinstance(code, int) else 0)


__all__ = ["main"]

if __name__ == "__main__":
    main()
