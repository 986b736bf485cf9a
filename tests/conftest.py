"""Shared test settings: hypothesis profiles.

``ci`` (the default) keeps the whole suite fast on a 2-core CI machine;
``slow`` runs at least 5,000 examples per property. Pick one with
``CPOSEMBED_HYPOTHESIS_PROFILE=slow python -m pytest``; or any number of
examples with ``CPOSEMBED_HYPOTHESIS_EXAMPLES=N``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(
    deadline=None,  # shared CI machines stall; a deadline would only add flakes
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)

settings.register_profile("ci", max_examples=100, derandomize=False, **_COMMON)
settings.register_profile("slow", max_examples=5000, **_COMMON)
settings.register_profile("dev", max_examples=20, **_COMMON)

settings.load_profile(os.environ.get("CPOSEMBED_HYPOTHESIS_PROFILE", "ci"))
if os.environ.get("CPOSEMBED_HYPOTHESIS_EXAMPLES"):
    # A one-off override, e.g. CPOSEMBED_HYPOTHESIS_EXAMPLES=1000 for a quick soak.
    settings.register_profile(
        "override",
        settings.get_profile(settings._current_profile),
        max_examples=int(os.environ["CPOSEMBED_HYPOTHESIS_EXAMPLES"]),
    )
    settings.load_profile("override")
