"""Acting on a profile: plan within a budget (``api``), sweep budgets (``frontier``), enforce a plan
on the live model (``applier``) and measure that it holds (``verify``)."""


__all__ = []
