"""Optimizer specs: which optimizer a step runs, by name, with the settings that move memory.

The CLI (``--optimizer``), ``StepSpec.optimizer``, profiles and plans carry one spec string;
the profiler and ``verify`` build the optimizer it names, and the framework callbacks compare
their Trainer's optimizer with the plan's through it. torch is imported only when a spec is read.

Example::

    parse_optimizer("RMSprop:centered=True,momentum=0.9")  # 'rmsprop:centered=True,momentum=0.9'
    parse_optimizer("SGD:momentum=0")                      # 'sgd:momentum=0.0' (remat's 'sgd' is momentum 0.9)
    parse_optimizer(functools.partial(torch.optim.SGD, momentum=0.9))  # 'sgd'
    build_optimizer("adafactor", params)                    # transformers' Adafactor as the Trainer builds it, lr=0
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import sys
from typing import Any

from planner.errors import BadInput

# NOTE [ Optimizer specs ]
# A spec names the optimizer of the step whose peak remat predicts: its state is alive at every
# step and its ``step()`` temporaries can make the peak, so the plan must be for the optimizer
# the user trains with.
#
# Rule 1. A spec is NAME or NAME:KEY=VALUE,KEY=VALUE. NAME is 'none', a class of torch.optim in
#   any case ('adamw', 'RMSprop', 'nadam'), 'adafactor' (transformers.optimization.Adafactor, the
#   one the Hugging Face Trainer builds; torch's is 'torch.optim.Adafactor'), or the dotted path
#   of any Optimizer subclass ('mypkg.optim.Lion'). KEYs are the class's constructor keywords,
#   VALUEs Python literals ('momentum=0.9', 'betas=(0.9,0.95)', 'amsgrad=True').
#   Why: the optimizer users train with, by the name they know, without a registry to keep.
# Rule 2. Presets: 'sgd' is momentum 0.9 (what remat's 'sgd' always was; torch's plain SGD is
#   'sgd:momentum=0'), 'adafactor' is scale_parameter=False, relative_step=False (the Trainer's);
#   every other class has its own defaults. A class named by its path ('torch.optim.SGD') or given
#   as a class is the class with its own defaults, and reads as a built one does ('sgd:momentum=0.0').
# Rule 3. The canonical spec (what profiles and plans record and what is compared) keeps the
#   settings that differ from the preset, keys sorted, and drops those that move no memory:
#   ``lr`` and the scalar hyperparameters of ``_NO_MEMORY`` (they are numbers inside the same
#   kernels), and ``weight_decay`` of the decoupled classes (an in-place multiply). Settings
#   that move memory stay: momentum (a buffer per parameter), amsgrad, centered, beta1 of
#   Adafactor (state), nesterov, maximize and coupled weight decay (a temporary per gradient).
# Rule 4. Profiling and ``verify`` step at lr=0 (same state, kernels and temporaries; weights
#   unchanged). Adafactor with relative_step=True computes its own lr: it runs with the
#   computed lr tensor zeroed in place, which allocates nothing more.
# Rule 5. Refused with a one-line reason: LBFGS (``step(closure)`` re-runs forward and backward
#   inside the step, which is not the step remat profiles), SparseAdam (sparse gradients only), a
#   class without an ``lr`` keyword (profiling would train the user's model, Rule 4),
#   ``foreach``/``fused`` (the recipe's: ``--foreach``/``--fused``), and those two
#   implementations for a class that has no such keyword.
# Rule 6. The step profiled and verified is a step of the steady state: after each step the
#   optimizer's step counts are advanced to at least ``STEADY_STEP`` (1000). Some optimizers
#   branch on the count: RAdam rectifies its update from step 6 on, with other temporaries
#   (with the peak in ``optimizer.step()``, 184,332 bytes of them against 73,740 in the first
#   five steps); a profile and a verify run of a few steps each would see different branches,
#   and neither the one training spends its steps in. The count moves only scalars elsewhere.

_NO_MEMORY = frozenset({"lr", "betas", "eps", "alpha", "rho", "lr_decay", "dampening", "momentum_decay",
                        "decay_rate", "clip_threshold", "initial_accumulator_value", "lambd", "t0", "etas",
                        "step_sizes", "beta2_decay"})
_DECOUPLED = frozenset({"adamw", "adafactor"})
_PRESETS: dict[str, dict[str, Any]] = {"sgd": {"momentum": 0.9},
                                       "adafactor": {"scale_parameter": False, "relative_step": False}}
_REFUSED = {"lbfgs": "its step(closure) re-runs forward and backward inside the optimizer step",
            "sparseadam": "it takes sparse gradients only"}
_IMPL_KEYS = ("foreach", "fused")


def parse_optimizer(value: Any) -> str:
    """``value`` as a canonical spec (NOTE [ Optimizer specs ]); ``BadInput`` in one line otherwise.
    In Python ``value`` may also be an Optimizer class or a ``functools.partial`` of one with keywords
    (``partial(torch.optim.SGD, momentum=0.9)``), as a training script builds its optimizer."""
    if isinstance(value, type) or isinstance(value, functools.partial) and isinstance(value.func, type):
        cls, args, kwargs = ((value.func, value.args, value.keywords) if isinstance(value, functools.partial)
                             else (value, (), {}))
        if args:
            raise BadInput(f"optimizer {value!r}: give its settings as keywords, not positional arguments")
        return parse_optimizer(spec_for(_optimizer_class(cls, repr(value)), kwargs))
    name, settings = _split(value)
    if name == "none":
        if settings:
            raise BadInput(f"optimizer 'none' takes no settings, got {value!r}")
        return "none"
    cls = _resolve(name)
    spec = _canonical(name, cls, settings)
    if "." in name:  # a class by its path ('torch.optim.SGD'): its own defaults, named as a built one is
        spec = spec_for(cls, settings)
    _construct(spec, cls, [_probe_parameter()], lr=0.0, impl="default")  # what the class refuses, now
    return spec


# NOTE [ Optimizer specs from files ]
# A plan or profile is data: nothing in it is executed, imported or unpickled (docs/cli.md, "Trust").
# Its optimizer spec may be a dotted path, and building or canonicalising it imports that module:
# a plan naming 'this.Zen' printed the Zen of Python in `remat verify`, 'antigravity.X' would open a
# browser (round 17 probe). Rule 1: a spec read from a file (``from_file``) names a class by its path
# only when its module is imported already (torch.optim, or the user's module that the model file,
# trusted code, imports); otherwise it is refused in one line saying so.


def from_file(spec: str, source: str) -> str:
    """``spec``, read from a ``source`` file ('plan' or 'profile'), once its class can be named without an
    import (NOTE [ Optimizer specs from files ]); ``BadInput`` otherwise."""
    name = _split(spec)[0] if isinstance(spec, str) and spec.strip() else ""
    module = name.rpartition(".")[0]
    if module and module not in sys.modules:
        raise BadInput(f"the {source} names optimizer {name!r}, and remat imports no module a {source} file names "
                       f"(files are data): import {module} in the model file, which is code you trust")
    return spec


def spec_for(cls: type, kwargs: dict[str, Any]) -> str:
    """The canonical spec of ``cls(params, **kwargs)``, e.g. the optimizer a Trainer builds: a preset
    setting not in ``kwargs`` is the class's default there ('sgd:momentum=0.0' for ``SGD(params)``)."""
    name = _name_of(cls)
    defaults = {k: _keywords(cls)[k] for k in _PRESETS.get(name, {})}
    return _canonical(name, cls, {**defaults, **{k: v for k, v in kwargs.items() if k not in _IMPL_KEYS}})


def spec_of(optimizer: Any) -> str:
    """The canonical spec of a built optimizer (a framework's, possibly wrapped by accelerate or
    Lightning): its class and the settings of its largest parameter group, which the Trainers
    give the weight decay the other groups (biases, norms) lack."""
    optimizer = unwrapped(optimizer)
    group = max(optimizer.param_groups, key=lambda g: sum(p.numel() for p in g["params"]))
    keywords = _keywords(type(optimizer))
    return spec_for(type(optimizer), {k: v for k, v in group.items() if k in optimizer.defaults and k in keywords})


def unwrapped(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` or a ``LightningOptimizer``."""
    for wrapper_attr in ("optimizer", "_optimizer"):
        optimizer = getattr(optimizer, wrapper_attr, optimizer)
    return optimizer


def impl_of(optimizer: Any) -> str:
    """``Recipe.optimizer_impl`` of a built optimizer: 'fused', 'foreach' or 'default'."""
    defaults = getattr(unwrapped(optimizer), "defaults", {})
    return "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "default"


def build_optimizer(spec: str, params: list[Any], *, lr: float = 0.0, impl: str = "default") -> Any:
    """The optimizer ``spec`` names over ``params`` at ``lr`` (None for 'none'); ``impl`` is
    ``Recipe.optimizer_impl`` ('default', 'foreach' or 'fused'), refused where the class lacks it."""
    spec = parse_optimizer(spec)
    if spec == "none":
        return None
    return _construct(spec, _resolve(_split(spec)[0]), params, lr=lr, impl=impl)


def check_impl(spec: str, impl: str) -> None:
    """``BadInput`` when ``impl`` ('foreach', 'fused') is no keyword of the class ``spec`` names (Rule 5)."""
    name = _split(spec)[0]
    if impl not in ("default", "foreach", "fused"):
        raise BadInput(f"unknown optimizer implementation {impl!r}; choose one of default, foreach, fused")
    if impl != "default" and (name == "none" or impl not in _keywords(_resolve(name))):
        which = "is none" if name == "none" else f"{name} has no {impl} implementation"
        raise BadInput(f"{{{impl}}} chooses the optimizer's implementation, but {{optimizer}} {which}: drop "
                       f"{{{impl}}} or pick an optimizer that has one", options=(impl, "optimizer"))


def _construct(spec: str, cls: type, params: list[Any], *, lr: float | None, impl: str) -> Any:
    """``cls`` over ``params`` with the preset and settings of canonical ``spec``; what the class
    refuses (warmup_init without relative_step, nesterov without momentum) as ``BadInput``."""
    name, settings = _split(spec)
    kwargs = {**_PRESETS.get(name, {}), **settings}
    accepted = _keywords(cls)
    check_impl(spec, impl)
    if "lr" not in accepted:
        raise BadInput(f"optimizer {name} takes no lr: remat steps at lr=0 so that profiling leaves the model's "
                       f"weights as they were; give the class an lr keyword")
    if name == "adafactor" and kwargs.get("relative_step", True):  # Rule 4
        cls, lr = _adafactor_at_lr_zero(cls), None
    kwargs["lr"] = lr
    try:
        opt = cls(params, **kwargs)
    except (TypeError, ValueError) as e:
        raise BadInput(f"optimizer {spec!r}: {cls.__name__} refuses these settings ({e})") from None
    for group in opt.param_groups:
        group.update({"default": {}, "foreach": {"foreach": True, "fused": None},
                      "fused": {"foreach": None, "fused": True}}[impl])
    opt.register_step_post_hook(_at_steady_step)  # Rule 6
    return opt


STEADY_STEP = 1000
"""The step count the optimizer's state is advanced to after each step it takes (Rule 6)."""


def _at_steady_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Each parameter's step count at least ``STEADY_STEP``, in place (a 0-d tensor or a number)."""
    for state in optimizer.state.values():
        step = state.get("step")
        if hasattr(step, "clamp_"):
            step.clamp_(min=STEADY_STEP)
        elif isinstance(step, (int, float)) and step < STEADY_STEP:
            state["step"] = type(step)(STEADY_STEP)


def accepted_names() -> str:
    """The names ``parse_optimizer`` takes, for messages and ``--help``."""
    return ", ".join(["adamw", "adam", "sgd", "adafactor", "none"]
                     + sorted(n for n in _torch_classes() if n not in ("adamw", "adam", "sgd", *_REFUSED))
                     + ["or the dotted path of an Optimizer subclass"])


def _split(value: Any) -> tuple[str, dict[str, Any]]:
    """'RMSprop:momentum=0.9' -> ('rmsprop', {'momentum': 0.9}); names of torch classes in lower case."""
    if not isinstance(value, str) or not value.strip():
        raise BadInput(f"unknown optimizer {value!r}; choose one of {accepted_names()}")
    head, _, tail = value.strip().partition(":")
    name = head.strip() if "." in head else head.strip().lower()
    settings: dict[str, Any] = {}
    for item in _items(tail):
        key, eq, text = item.partition("=")
        try:
            settings[key.strip()] = ast.literal_eval(text.strip()) if eq else None
        except (ValueError, SyntaxError):
            raise BadInput(f"optimizer setting {item.strip()!r} of {value!r}: the value must be a Python literal "
                           f"(0.9, True, None, (0.9, 0.95))") from None
        if not eq:
            raise BadInput(f"optimizer setting {item.strip()!r} of {value!r} is not KEY=VALUE")
    return name, settings


def _items(tail: str) -> list[str]:
    """'a=1,b=(2,3)' -> ['a=1', 'b=(2,3)']: commas inside brackets stay."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(tail):
        depth += (ch in "([") - (ch in ")]")
        if ch == "," and depth == 0:
            items.append(tail[start:i])
            start = i + 1
    items.append(tail[start:])
    return [s for s in items if s.strip()]


def _resolve(name: str) -> type:
    """The class ``name`` names (Rule 1); ``BadInput`` for an unknown or refused one (Rule 5)."""
    if name in _REFUSED:
        raise BadInput(f"optimizer {name!r} is not supported: {_REFUSED[name]}")
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor
    if "." not in name:
        cls = _torch_classes().get(name)
        if cls is None:
            raise BadInput(f"unknown optimizer {name!r}; choose one of {accepted_names()}")
        return cls
    if not all(part.isidentifier() for part in name.split(".")):  # '.', 'a..b', '1a.b': no path to import
        raise BadInput(f"unknown optimizer {name!r}; choose one of {accepted_names()} (e.g. mypkg.optim.Lion)")
    module, _, attr = name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except Exception as e:  # noqa: BLE001 - importing a user's module runs its code, which may raise anything
        raise BadInput(f"optimizer {name!r}: cannot import it ({type(e).__name__}: {e})") from None
    return _optimizer_class(cls, repr(name))


def _optimizer_class(cls: Any, said: str) -> type:
    import torch

    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise BadInput(f"optimizer {said} is not a torch.optim.Optimizer subclass")
    return cls


def _torch_classes() -> dict[str, type]:
    import torch

    found = {n.lower(): getattr(torch.optim, n) for n in dir(torch.optim)}
    return {n: c for n, c in found.items() if n != "adafactor" and isinstance(c, type)
            and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer}


def _name_of(cls: type) -> str:
    """The spec name of ``cls``: its torch.optim name, 'adafactor', or its dotted path."""
    if cls.__module__.startswith("transformers.") and cls.__name__ == "Adafactor":
        return "adafactor"
    if _torch_classes().get(cls.__name__.lower()) is cls:
        return cls.__name__.lower()
    return f"{cls.__module__}.{cls.__qualname__}"


def _keywords(cls: type) -> dict[str, Any]:
    """Constructor keyword -> default (``inspect.Parameter.empty`` when it has none)."""
    params = list(inspect.signature(cls.__init__).parameters.values())[2:]  # self, params
    return {p.name: p.default for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _canonical(name: str, cls: type, settings: dict[str, Any]) -> str:
    """Rule 3: the settings that differ from ``name``'s preset and move memory, sorted."""
    keywords = _keywords(cls)
    for key in settings:
        if key in _IMPL_KEYS:
            raise BadInput(f"optimizer setting {key!r} is the step's implementation: give --{key} "
                           f"(Recipe(optimizer_impl={key!r})) instead")
        if key not in keywords:
            raise BadInput(f"optimizer {name} has no setting {key!r}; it takes {', '.join(sorted(keywords))}")
    base = {**keywords, **_PRESETS.get(name, {})}
    neutral = _NO_MEMORY | ({"weight_decay"} if name in _DECOUPLED else set())
    kept = {k: _like(v, base[k]) for k, v in settings.items() if k not in neutral and not _same(v, base[k])}
    return name + (":" + ",".join(f"{k}={kept[k]!r}" for k in sorted(kept)) if kept else "")


def _like(value: Any, default: Any) -> Any:
    """``value`` with the type of a float ``default`` when it is an int ('momentum=0' -> 0.0)."""
    return float(value) if isinstance(default, float) and type(value) is int else value


def _same(value: Any, default: Any) -> bool:
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    try:
        return bool(value == default)
    except Exception:  # noqa: BLE001 - a default that does not compare (a tensor) is not the value
        return False


def _probe_parameter() -> Any:
    import torch

    return torch.nn.Parameter(torch.zeros(1, 1, device="cpu"))  # not the model file's default device


def _adafactor_at_lr_zero(cls: type) -> type:
    """``cls`` (transformers' Adafactor) whose relative-step lr is zeroed in place (Rule 4)."""

    class AdafactorAtLrZero(cls):  # type: ignore[misc, valid-type]
        @staticmethod
        def _get_lr(param_group: dict[str, Any], param_state: dict[str, Any]) -> Any:
            lr = cls._get_lr(param_group, param_state)
            return lr.mul_(0) if hasattr(lr, "mul_") else 0.0

    return AdafactorAtLrZero


__all__ = ["from_file", "accepted_names", "build_optimizer", "parse_optimizer", "spec_for", "spec_of", "impl_of", "check_impl", "unwrapped"]
