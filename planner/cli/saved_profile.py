"""Options given with ``--profile``: which a saved profile can honour (NOTE [ Options a saved profile cannot
honour ]), checked before anything is planned on it.

Example::

    check_profile_options(Profile.load(path), options, path)   # BadInput naming an option the profile cannot honour
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from planner.cli.options import StepOptions
from planner.errors import BadInput
from planner.model.schema import Recipe
from planner.options import compile_backend


# NOTE [ Options a saved profile cannot honour ]
#
# With --profile nothing runs: the profile was measured once, on one device, for one step.
# Rule 1. Options that say how to measure (--device, --device-memory, --steps, --threads) cannot
#   change it: typed with --profile, they are refused by name (the environment's
#   REMAT_DEVICE_MEMORY is a machine-wide default, not a request, and is not refused).
# Rule 2. Options that say which step (--optimizer and the recipe: --amp, --grad-accum,
#   --no-zero-grad-set-to-none, --clip-grad-norm, --fused/--foreach) are honoured when the profile
#   measured that step and refused, naming the difference, when it did not. An option left at its
#   default plans the profile's own step.
# Rule 3. --target is honoured (it sets the default budget); a meta profile, whose times were
#   modelled for one target, refuses another.

MEASURING_OPTIONS = ("device", "device_memory", "steps", "threads")
"""Options that only say how a step is measured (Rule 1)."""


def check_profile_options(prof: Any, o: StepOptions, path: Path) -> None:
    """BadInput when an option cannot be honoured on the saved profile ``prof`` (NOTE above)."""
    typed = [name for name in MEASURING_OPTIONS if name in o.given]
    if typed:
        raise BadInput(f"{' and '.join('{' + n + '}' for n in typed)} {'say' if len(typed) > 1 else 'says'} how to "
                       f"measure a step, and {path} was "
                       f"measured already (nothing runs with --profile): drop {'them' if len(typed) > 1 else 'it'}, "
                       f"or re-profile with {'them' if len(typed) > 1 else 'it'}", options=tuple(typed))
    wrong = [f"{{optimizer}} {o.optimizer} (the profile has {prof.optimizer})"
             if "optimizer" in o.given and o.optimizer != prof.optimizer else ""]
    default, typed_recipe = Recipe(), {"optimizer_impl" if n in ("fused", "foreach") else n for n in o.given}
    named = ["optimizer", "target"]
    for name in prof.recipe.differing_fields(o.recipe):
        if name in typed_recipe or getattr(o.recipe, name) != getattr(default, name):
            said = "the optimizer implementation" if name == "optimizer_impl" else "{" + name + "}"
            named.append(name)
            wrong.append(f"{said} {getattr(o.recipe, name)!r} (the profile has {getattr(prof.recipe, name)!r})")
    if prof.device == "meta" and "target" in o.given and o.target is not None:
        from planner.profiling.devices import get_device

        if get_device(o.target).name != prof.target:
            wrong.append(f"{{target}} {o.target} (the profile's times were modelled for {prof.target})")
    asked = compile_backend(o.compile, o.compile_backend)
    if "compile" in o.given and asked != (prof.compile and prof.compile.backend):
        wrong.append(f"{{compile}} (the profile measured the {'compiled' if prof.compile else 'eager'} step)")
        named.append("compile")
    wrong = [w for w in wrong if w]
    if wrong:
        raise BadInput(f"{path} was measured for another training step: {'; '.join(wrong)}; re-profile with "
                       f"these options, or drop them to plan the profile's step", options=tuple(named))


__all__ = ["check_profile_options", "MEASURING_OPTIONS"]
