"""Shared test settings: hypothesis profiles.

``ci`` (the default) keeps the whole suite fast on a 2-core CI machine;
``slow`` runs at least 5,000 examples per property. Pick one with
``CPOSEMBED_HYPOTHESIS_PROFILE=slow python -m pytest``; or any number of
examples with ``CPOSEMBED_HYPOTHESIS_EXAMPLES=N``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = {
    "deadline": None,  # shared CI machines stall; a deadline would only add flakes
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
    "print_blob": True,
}

# CI is deterministic (the same examples every run, so it never flakes);
# the slow profile explores new random examples each time.
settings.register_profile("ci", max_examples=100, derandomize=True, database=None, **_COMMON)
settings.register_profile("slow", max_examples=5000, **_COMMON)
settings.register_profile("dev", max_examples=20, **_COMMON)

_profile = os.environ.get("CPOSEMBED_HYPOTHESIS_PROFILE", "ci")
settings.load_profile(_profile)
if os.environ.get("CPOSEMBED_HYPOTHESIS_EXAMPLES"):
    # A one-off override, e.g. CPOSEMBED_HYPOTHESIS_EXAMPLES=1000 for a quick soak.
    settings.register_profile(
        "override",
        settings.get_profile(_profile),
        max_examples=int(os.environ["CPOSEMBED_HYPOTHESIS_EXAMPLES"]),
    )
    settings.load_profile("override")
