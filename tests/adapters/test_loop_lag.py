"""The event-loop lag gauge: how late a periodic timer ran, the worst of a window."""

from __future__ import annotations

import asyncio
import time

from extproc.adapters.loop_lag import LoopLag


async def test_a_blocked_loop_shows_as_lag_and_ages_out_of_the_window() -> None:
    lag = LoopLag(interval_s=0.02, window_s=0.2)  # the worst of the last 10 samples
    assert lag.worst() is None  # no sample yet: the series is left out
    lag.start()
    await asyncio.sleep(0.1)
    idle = lag.worst()
    # Thresholds far from the figures: a collection in this test process may pause it.
    assert idle is not None and idle < 0.3
    time.sleep(0.6)  # noqa: ASYNC251  (on purpose: the loop blocked)
    await asyncio.sleep(0.05)
    blocked = lag.worst()
    assert blocked is not None and blocked >= 0.5
    # Once 10 on-time samples follow, the block has left the window (bounded wait).
    for _ in range(100):
        await asyncio.sleep(0.05)
        after = lag.worst()
        if after is not None and after < 0.3:
            break
    assert after is not None and after < 0.3
    await lag.stop()
