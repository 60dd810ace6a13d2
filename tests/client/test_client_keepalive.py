"""A result stream whose connection goes silent (a partition: no FIN, no RST) is noticed by the
client's keepalive pings and resumed on a new connection, even after a quiet spell of several ping
intervals. Without `grpc.http2.max_pings_without_data` 0 the client stops pinging after two pings
without data and never notices; without `grpc.http2.ping_timeout_ms` the unacknowledged ping is timed
out after a minute, not after keepalive_timeout_seconds. Either way this test ends in its SeerTimeout.
(A first version passed regardless: its proxy could forward bytes read just before the freeze.)"""

from __future__ import annotations

import time

import pytest
from client_helpers import Buffer, finish_request
from seer_client import PromptGroup, SeerClient, SeerError

from tests.common.netfault import FreezingProxy


def test_a_partitioned_quiet_stream_is_noticed_and_resumed(buffer: Buffer) -> None:
    proxy = FreezingProxy(("127.0.0.1", buffer.cfg.port))
    try:
        with SeerClient(proxy.address, keepalive_seconds=0.5, keepalive_timeout_seconds=1.0) as client:
            client.submit_batch("k", [PromptGroup(prompt=[1, 2, 3], group_size=2, max_tokens=4)])
            finish_request(buffer.address, "k/0/0")
            # The timeout turns a hang (the failure this test is for) into a SeerTimeout.
            it = client.iter_results("k", timeout=30)
            assert next(it).request_id == "k/0/0"
            time.sleep(2.5)  # a quiet spell: five keepalive intervals without a result
            assert proxy.freeze() >= 1
            finish_request(buffer.address, "k/0/1")  # straight to the buffer, not through the proxy
            t0 = time.monotonic()
            assert [r.request_id for r in it] == ["k/0/1"]
            # Noticed within about one interval plus the ping timeout, then resumed from the cursor.
            assert time.monotonic() - t0 < 10
    finally:
        proxy.close()


@pytest.mark.parametrize("field", ["keepalive_seconds", "keepalive_timeout_seconds"])
@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "30"])
def test_bad_keepalive_settings_name_the_field(field: str, value: object) -> None:
    with pytest.raises(SeerError) as e:
        SeerClient("127.0.0.1:1", **{field: value})  # type: ignore[arg-type]
    assert e.value.code == "INVALID_ARGUMENT" and field in str(e.value)
