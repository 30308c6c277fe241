"""The ``remat`` command line: its commands (``app``) and how results look (``render``, ``plot``)."""


__all__ = []
