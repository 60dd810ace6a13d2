"""The draft server's client of the buffer: the newest history iteration of a prompt key (tokens)."""

from __future__ import annotations

from collections.abc import Sequence

from seer.v1 import buffer_pb2, buffer_pb2_grpc

from services.common.grpcutil import channel
from services.draft.backfill import BufferIteration


class BufferHistoryLink:
    """GetHistory(include_tokens) over one long-lived channel; errors propagate as grpc.RpcError
    (HistoryBackfill logs them and asks again later)."""

    def __init__(self, address: str, timeout_s: float = 10.0) -> None:
        if not address:
            raise ValueError("buffer_address: must not be empty")
        self._channel = channel(address)
        self._stub = buffer_pb2_grpc.BufferInternalServiceStub(self._channel)
        self._timeout_s = timeout_s

    def fetch(self, prompt_key: str) -> Sequence[Sequence[int]]:
        return self.fetch_iteration(prompt_key).responses

    def fetch_iteration(self, prompt_key: str) -> BufferIteration:
        """The newest iteration with the policy version that generated it (the history iteration
        the draft server seeds it as); no responses when the buffer has none."""
        resp = self._stub.GetHistory(buffer_pb2.GetHistoryRequest(prompt_keys=[prompt_key], include_tokens=True),
                                     timeout=self._timeout_s)
        for h in resp.histories:
            if h.prompt_key == prompt_key:
                return BufferIteration(h.policy_version, [list(r.token_ids) for r in h.responses])
        return BufferIteration(0, [])

    def close(self) -> None:
        self._channel.close()

