"""`python -m cluster.shutdown [--app NAME] [--grace-s S]`: let a running application's requests finish
before it stops (deploy/serve.sh runs it on SIGTERM / Ctrl-C, then stops `serve run`).

Connects to the local Ray cluster as a driver and calls `Ingress.drain(grace_s)` on every ingress replica:
each stops admitting (503 + Retry-After, /health 503) and returns once its requests are over; what still
runs after `grace_s` ends with a `shutting_down` error event and [DONE]. The workers are then idle, so
stopping Serve cuts nothing. Exit status 0 once every replica drained, 1 if one could not be reached.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import List, Optional

DEFAULT_GRACE_S = 30.0
"""How long running requests may take to finish (deploy/serve.sh: $RADIXSERVE_GRACE_S)."""


def drain(app: str, grace_s: float) -> List[int]:
    """Drain every ingress replica of `app` (this process is connected to its Ray cluster); returns, per
    replica, the requests it was running."""
    from ray import serve

    handle = serve.get_deployment_handle("Ingress", app)
    return list(handle.broadcast("drain", grace_s).results(timeout_s=grace_s + 30))


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.shutdown", description=__doc__.split("\n\n")[0])
    p.add_argument("--app", default="default", help="Serve application name (serve run's default: default)")
    p.add_argument("--grace-s", type=float, default=DEFAULT_GRACE_S, help="time running requests get")
    args = p.parse_args(argv)
    # Serve's throughput preset (deploy/serve.sh exports it) makes handles route on the caller's event loop;
    # this driver has none, so its handle routes on a loop of its own. Read when ray.serve is first imported.
    os.environ["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] = "1"
    import ray

    try:  # the cluster `serve run` started or joined: it resolves "auto" the same way
        ray.init(address="auto", namespace="serve", logging_level=logging.WARNING, log_to_driver=False)
        running = drain(args.app, args.grace_s)
    except Exception as exc:  # noqa: BLE001 - reported; the caller stops the application anyway
        print(f"radixserve: drain failed: {exc!r}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    print(f"radixserve: drained {len(running)} ingress replica(s), {sum(running)} request(s) were running")
    return 0


if __name__ == "__main__":
    sys.exit(main())
