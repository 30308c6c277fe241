"""The root of remat's error types, torch-free so that solvers and the cost model can raise them.

``planner.errors`` re-exports both and adds the rest; the CLI turns any ``RematError`` into one
line on stderr and its ``exit_code``.

Example::

    raise SolverError("unknown solver 'x'; choose one of: auto, dp, ilp")
"""

from __future__ import annotations

from collections.abc import Mapping


class RematError(Exception):
    """Base class. ``exit_code`` is what the CLI exits with: 2 bad input, 1 plan/verify failed.

    A message may name the options that fix it as ``{name}`` fields listed in ``options`` (e.g.
    ``{time_limit_s}``): ``str(e)`` shows the Python parameter names, ``worded(names)`` another
    caller's (the CLI's flags, such as ``--time-limit``).
    """

    exit_code = 2

    def __init__(self, message: str, *, options: tuple[str, ...] = ()):
        self.template = message
        self.options = options
        super().__init__(self.worded({}))

    def worded(self, names: Mapping[str, str]) -> str:
        """The message with each of ``options`` called what ``names`` calls it (default: itself)."""
        text = self.template
        for option in self.options:
            text = text.replace("{" + option + "}", names.get(option, option))
        return text


class SolverError(RematError):
    """An unknown solver, or a solver that cannot handle this graph."""


__all__ = ["RematError", "SolverError"]
