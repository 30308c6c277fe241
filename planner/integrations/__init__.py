"""remat inside training frameworks: Hugging Face (``hf``, ``hf_config``), Lightning (``lightning``).

Each module imports its framework when it is imported; ``planner`` itself never does.
"""


__all__ = []
