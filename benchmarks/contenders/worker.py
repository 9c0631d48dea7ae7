"""A contender's process: set up one contender on one workload, then train an epoch
each time the driver asks, and report its peak memory at the end.

    python benchmarks/contenders/worker.py <module> <kind> <workload folder> <optimizer>

``<module>`` is ``graphkit_peer``, ``torch_peer`` or ``jax_peer`` (each imports only
what its own environment has); its ``make(kind, spec)`` returns the epoch, a callable
that trains one epoch and returns its mean batch loss. The protocol is one JSON line per
message on a private copy of stdout (whatever a library prints goes to stderr):

* after setup: ``{"ready": true, "version": what runs it}``, or ``{"skip": reason}``
  and the process ends;
* for each line ``epoch`` on stdin: ``{"seconds": s, "loss": l}`` (or ``{"error": why}``
  and the process ends);
* for the line ``done``: ``{"peak": bytes, "extra": bytes}`` and the process ends.

*peak* is the process's peak resident memory (imports, data and training); *extra* is
the peak beyond what the process held once imports and data were loaded (VmHWM reset
there), as ``run.py`` measures it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

from spec import NotApplicable, load


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    module_name, kind, folder, optimizer = sys.argv[1:5]
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # prints of libraries go to stderr, the protocol keeps its own stdout

    def send(message: dict) -> None:
        out.write(json.dumps(message) + "\n")

    module = importlib.import_module(module_name)
    spec = load(Path(folder), optimizer)
    startup_peak = _status("VmHWM")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM: imports and data are not counted in *extra*
    before = _rss()
    try:
        epoch = module.make(kind, spec)
    except NotApplicable as exc:
        send({"skip": str(exc)})
        return
    except Exception as exc:
        send({"error": f"{type(exc).__name__}: {exc}"[:300]})
        raise
    send({"ready": True, "version": module.VERSION})
    for line in sys.stdin:
        command = line.strip()
        if command == "epoch":
            start = time.perf_counter()
            try:
                loss = epoch()
            except Exception as exc:  # the contender fails on this workload: say why
                send({"error": f"{type(exc).__name__}: {exc}"[:300]})
                raise
            send({"seconds": time.perf_counter() - start, "loss": float(loss)})
        elif command == "done":
            peak = _status("VmHWM")
            send({"peak": max(peak, startup_peak), "extra": peak - before})
            return


if __name__ == "__main__":
    main()
