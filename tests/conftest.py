"""Shared test configuration."""

import os

from hypothesis import settings

# CI runs a fixed set of examples (a red CI must be reproducible, not a lucky draw); a developer's
# run draws new ones, so the property tests keep searching. HYPOTHESIS_PROFILE=ci reproduces CI.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default"))
