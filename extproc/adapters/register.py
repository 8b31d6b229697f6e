"""`extproc register`: the agent beside each model server that keeps it in the live pool.

It probes its model server's health endpoint (`pool.health_check`'s path, interval and
thresholds) and executes what `core.membership.Agent` decides: register on a lease of
`pool.registration_ttl_s`, keep it alive, withdraw it when the server stops answering or
the agent is told to stop. If the agent dies, the lease lapses and the replica leaves the
pool within the TTL. It speaks to etcd with the same settings as the processor (TLS, auth).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..core.config import Config
from ..core.membership import Agent, AgentAction, AgentPolicy
from .etcd_pool import EtcdPoolRegistry
from .etcd_store import EtcdStore
from .leases import StoreUnavailable
from .prober import probe_once
from .timers import LoopTimers, Timers, wait_for

log = logging.getLogger("extproc.register")
_NOID = {"request_id": None, "attempt_id": None}


async def run_agent(cfg: Config, record: Mapping[str, Any], probe_address: str,
                    stop: asyncio.Event | None = None,
                    on_probe: Callable[[bool], None] | None = None,
                    signals: bool = True, timers: Timers | None = None,
                    clock: Callable[[], float] = time.monotonic) -> int:
    """Register, keep and withdraw. `on_probe` hears every probe's verdict (the replica
    agent's /healthz follows it); `signals` False leaves SIGTERM to the caller. The probe
    interval and timeout are waited on `timers` (the loop's by default), read on `clock`."""
    timers = timers or LoopTimers()
    address = str(record["address"])
    hc = cfg.pool.health_check
    store = EtcdStore(cfg.etcd, owner=f"register/{address}")
    await store.connect()
    registry = EtcdPoolRegistry(store)
    agent = Agent(AgentPolicy(ttl_s=cfg.pool.registration_ttl_s,
                              healthy_threshold=hc.healthy_threshold,
                              unhealthy_threshold=hc.unhealthy_threshold))
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT) if signals else ():
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    lease = 0
    info = {**_NOID, "replica": address}

    async def execute(action: AgentAction) -> bool | None:
        nonlocal lease
        if action is AgentAction.REGISTER:
            try:
                lease = await registry.register(address, record, cfg.pool.registration_ttl_s)
            except StoreUnavailable as e:
                log.warning("registration not made: etcd unavailable",
                            extra={**info, "error": str(e)})
                return None
            log.info("replica registered", extra={**info, "lease": lease,
                                                  "ttl_s": cfg.pool.registration_ttl_s})
            return True
        if action is AgentAction.KEEP_ALIVE:
            kept = await registry.keep_alive(lease)
            if kept is False:
                log.warning("registration lapsed in etcd; registering again",
                            extra={**info, "lease": lease})
            return kept
        done = await registry.withdraw(lease)
        log.info("replica withdrawn" if done else
                 "withdrawal not confirmed by etcd; the registration lapses with its lease",
                 extra={**info, "lease": lease})
        lease = 0
        return done

    log.info("register agent started", extra={**info, "probe": probe_address,
                                              "path": hc.path})
    try:
        while not stop.is_set():
            ok = True if not hc.enabled else await probe_once(probe_address, hc.path,
                                                               hc.timeout_s, timers)
            if on_probe is not None:
                on_probe(ok)
            now = clock()
            action = agent.probed(ok, now)
            if action is not None:
                if action is AgentAction.DEREGISTER:
                    log.warning("model server failed its health checks",
                                extra={**info, "failed": agent.bad})
                agent.done(action, await execute(action), clock())
            with contextlib.suppress(TimeoutError):
                await wait_for(timers, stop.wait(), hc.interval_s)
        final = agent.stop()
        if final is not None:
            agent.done(final, await execute(final), clock())
    finally:
        await store.close()
    return 0
