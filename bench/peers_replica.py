"""The demo replica with a fault armed from outside, for gateways that drop unknown headers.

    python -m bench.peers_replica --arm-file PATH <the demo replica's own arguments>

bench/peers.py compares gateways on what a client sees when a replica dies before or after
the first delta. The demo replica's fault hooks are driven by the `x-replica-fault` request
header, which Envoy forwards but the SGLang model gateway does not (and LiteLLM only with a
setting). Here the driver writes the fault (e.g. `kill-after-headers`) into PATH instead;
the first chat request to reach any replica that shares PATH renames the file (atomic, so
exactly one replica of the pool takes it) and runs as if it carried the header. Every other
request, the retry included, runs clean. The fault itself is the demo replica's own code.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from devkit.demo import replica as demo


def take_fault(arm_file: str, name: str) -> str | None:
    """The armed fault, if this replica is the first to claim it; None otherwise."""
    taken = f"{arm_file}.taken-{name}"
    try:
        os.rename(arm_file, taken)
    except OSError:
        return None
    spec = Path(taken).read_text().strip()
    return spec or None


def armed_middleware(arm_file: str, name: str) -> Any:
    @web.middleware
    async def armed(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method == "POST" and request.path.endswith("/completions"):
            spec = take_fault(arm_file, name)
            if spec is not None:
                headers = CIMultiDict(request.headers)
                headers[demo.FAULT_HEADER] = spec
                headers[demo.FAULT_ATTEMPT_HEADER] = "all"
                request = request.clone(headers=headers)
        result: web.StreamResponse = await handler(request)
        return result

    return armed


async def serve(args: argparse.Namespace, arm_file: str) -> None:
    replica = demo.Replica(args.name, args.model, args.log_file, args.token_delay_ms / 1000.0,
                           args.tool_gateway)
    app = demo.build_app(replica)
    app.middlewares.append(armed_middleware(arm_file, args.name))
    runner = web.AppRunner(app, access_log=None, handler_cancellation=False,
                           shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    replica.port = args.port
    print(f"armed demo replica {args.name} on {args.host}:{args.port} (arm file {arm_file})",
          file=sys.stderr, flush=True)
    await demo.until_signalled(runner)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--arm-file", required=True)
    known, rest = ap.parse_known_args(argv)
    asyncio.run(serve(demo.parse_args(rest), known.arm_file))


if __name__ == "__main__":
    main()
