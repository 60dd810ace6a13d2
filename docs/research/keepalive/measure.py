"""Time from a silent cut of a quiet result stream to the next result, with the client's default
settings, session 21's keepalive options against session 20's (keepalive 30 s, gRPC's defaults).
Run from the repository root: `PYTHONPATH=$PWD .venv/bin/python docs/research/keepalive/measure.py`
(about 90 s; both clients run at once, each against its own buffer and freezing proxy)."""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, "tests/client")
import seer_client.client as sc
from client_helpers import Buffer, finish_request
from seer_client import PromptGroup, SeerClient

from tests.common.netfault import FreezingProxy


def run(label: str, old: bool, out: dict[str, float]) -> None:
    b = Buffer(Path(tempfile.mkdtemp()) / "db")
    b.start()
    proxy = FreezingProxy(("127.0.0.1", b.cfg.port))
    if old:  # session 20's client channel: keepalive 30 s, everything else gRPC's default
        ch = grpc.insecure_channel(proxy.address, options=[*sc._OPTIONS, ("grpc.keepalive_time_ms", 30_000)])
        client = SeerClient(proxy.address, channel=ch)
    else:
        client = SeerClient(proxy.address)
    client.submit_batch("k", [PromptGroup(prompt=[1, 2], group_size=2, max_tokens=4)])
    finish_request(b.address, "k/0/0")
    it = client.iter_results("k", timeout=300)
    next(it)
    time.sleep(5)
    proxy.freeze()
    finish_request(b.address, "k/0/1")
    t0 = time.monotonic()
    next(it)
    out[label] = round(time.monotonic() - t0, 1)
    client.close()
    proxy.close()
    b.stop()


def main() -> None:
    out: dict[str, float] = {}
    threads = [threading.Thread(target=run, args=(label, old, out)) for label, old in (("new", False), ("old", True))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(out)


if __name__ == "__main__":
    main()
