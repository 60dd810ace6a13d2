"""The Node.js client (clients/node/rollout.js) notices a result stream whose connection goes silent
(a partition: no FIN, no RST) by its keepalive pings and resumes it from the cursor on a new
connection, the Node counterpart of test_client_keepalive.py. The client talks to a real buffer
through a loopback proxy (tests/common/netfault.FreezingProxy) that is frozen in the middle of the
stream after a quiet spell of several ping intervals; the remaining results are committed straight
to the buffer and reach the client only if it reconnects. Without keepalive (or with its 30 s
default) the client hangs until --timeout and the run fails."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from client_helpers import Buffer, Node, _free_port, _ok, finish_request

from tests.common.netfault import FreezingProxy


def test_node_notices_a_partitioned_quiet_stream_and_resumes(node_client: Path, tok_buffer: Buffer) -> None:
    proxy = FreezingProxy(("127.0.0.1", tok_buffer.cfg.port))
    try:
        # --timeout turns a hang (the failure this test is for) into a failed run; the retry window
        # leaves room for a reconnect on a loaded machine.
        n = Node(node_client, tok_buffer, "node-ka", "--keepalive-seconds", "0.5",
                 "--keepalive-timeout-seconds", "1", "--timeout", "25", "--retry-seconds", "15",
                 address=proxy.address)
        finish_request(tok_buffer.address, "node-ka/0/0")
        finish_request(tok_buffer.address, "node-ka/0/1")
        n.wait_results(2)
        time.sleep(2.5)  # a quiet spell: five keepalive intervals without a result
        assert proxy.freeze() >= 1
        t0 = time.monotonic()
        finish_request(tok_buffer.address, "node-ka/1/0")  # straight to the buffer, not through the proxy
        finish_request(tok_buffer.address, "node-ka/1/1")
        rc, out = n.finish(timeout=40)
        took = time.monotonic() - t0
    finally:
        proxy.close()
    assert _ok(rc, out), "\n".join(out)
    results = [line for line in out if line.startswith("result ")]
    assert len(results) == 4 and len({r.split(":")[0] for r in results}) == 4, out  # each result once
    # The dropped connection failed the stream UNAVAILABLE (14) and it was reopened from its cursor.
    assert any(line.startswith("retrying after 14 ") for line in out), out
    # Noticed within about one ping interval plus the ping timeout (and a reconnect), far from the
    # 25 s --timeout a hang runs into.
    assert took < 10, (took, out)


@pytest.mark.parametrize("args, message", [
    (("--keepalive-seconds", "0"), "--keepalive-seconds: must be a positive number of seconds"),
    (("--keepalive-seconds", "nan"), "--keepalive-seconds: must be a positive number of seconds"),
    (("--keepalive-timeout-seconds", "-1"), "--keepalive-timeout-seconds: must be a positive number of seconds"),
    (("--keepalive-timeout-seconds", "1s"), "--keepalive-timeout-seconds: must be a positive number of seconds"),
])
def test_node_refuses_bad_keepalive_settings(node_client: Path, args: tuple[str, str], message: str) -> None:
    proc = subprocess.run(["node", str(node_client), "--address", f"127.0.0.1:{_free_port()}", *args],
                          cwd=node_client.parent, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and message in proc.stderr, (proc.stdout, proc.stderr)
