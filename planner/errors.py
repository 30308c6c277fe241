"""Error types. Every failure a user can cause maps to one of these; the CLI turns them
into one line on stderr and an exit code (see ``exit_code``).

Example::

    try:
        planner.plan(model, "1MB", inputs=batch)
    except BudgetInfeasible as e:
        print(e.min_feasible_bytes)
"""

from __future__ import annotations

from collections.abc import Sequence

from solvers.errors import RematError, SolverError

__all__ = ["BadInput", "BudgetInfeasible", "ModelLoadError", "PlanFileError", "PlanMismatch", "ProfileError",
           "RematError", "SolverError", "Terminated", "VerificationFailed", "WriteFailed", "listed"]


def listed(names: Sequence[str], shown: int = 4) -> str:
    """``'a, b, c, d and 3 more'``: the first ``shown`` of ``names`` and how many more, as every message lists
    names (modules, threads) that may be many."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


class BadInput(RematError):
    """An argument or option has the wrong form (budget string, path, name)."""


class ModelLoadError(RematError):
    """``model.py`` is missing, does not import, or breaks the model-file convention."""


class WriteFailed(BadInput, OSError):
    """Writing an output file failed part way (disk or quota full, a file size limit, an I/O error); the old
    file is as it was (NOTE [ Writing output files ], Rule 6). Still an ``OSError``, for callers that catch one.
    ``errno``: the failed call's."""

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno


class ProfileError(RematError):
    """Running the training step to profile it failed (user code raised, OOM, bad loss)."""


OOM_HINT = ("the step does not fit on this device as it is. Use --device meta to plan without running, "
            "or a smaller batch")
"""What every out-of-memory message ends with, whichever device ran out (the CLI's too)."""


class PlanFileError(RematError):
    """A plan or profile file is empty, truncated, not JSON, or not of the expected schema."""


class PlanMismatch(RematError):
    """A plan was made for another model or other input shapes. ``differences`` lists them."""

    SHOWN = 12
    """Differences a message lists; ``differences`` holds them all (a 7B model renamed differs in hundreds)."""

    def __init__(self, message: str, differences: list[str] | None = None):
        super().__init__(message)
        self.differences = list(differences or [])

    @classmethod
    def listing(cls, head: str, differences: list[str], advice: str) -> "PlanMismatch":
        """``head``, the first ``SHOWN`` differences one a line (then how many more), and ``advice``."""
        shown = differences[:cls.SHOWN]
        more = [f"... and {len(differences) - len(shown)} more"] if len(differences) > len(shown) else []
        return cls(f"{head}:\n  " + "\n  ".join(shown + more) + f"\n{advice}", differences)


class BudgetInfeasible(RematError):
    """No checkpoint set fits the budget. Carries the minimum feasible budget in bytes."""

    exit_code = 1

    def __init__(self, message: str, *, budget_bytes: int, min_feasible_bytes: int | None,
                 options: tuple[str, ...] = ()):
        super().__init__(message, options=options)
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes


class VerificationFailed(RematError):
    """Measured peak over the budget, or gradients differ beyond tolerance."""

    exit_code = 1


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived while a command ran (see NOTE [ Signals and children ] in planner/children.py).
    A KeyboardInterrupt, so that everything that cleans up after Ctrl-C cleans up after it too. ``signum``:
    the signal; the CLI exits 128 + it."""

    def __init__(self, message: str = "terminated", signum: int = 15):
        super().__init__(message)
        self.signum = signum
