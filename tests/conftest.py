"""Settings every suite shares.

Hypothesis's per-example deadline is a timed test: on a loaded machine (CI, or a lead running
benchmarks beside the suite) a correct property can fail it. Performance is measured in
bench/, so no property here has a wall-clock limit.
"""

from hypothesis import settings

settings.register_profile("no-deadline", deadline=None)
settings.load_profile("no-deadline")
