"""What passes between the stages: the ``Profile`` and ``Plan`` files (``schema``), the candidate
graph built from a profile (``graph``), and the model's structure that a plan is checked against
(``fingerprint``). ``synthetic`` makes profiles without running a model, for tests and benchmarks."""


__all__ = []
