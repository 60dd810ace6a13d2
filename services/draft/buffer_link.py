"""The draft server's client of the buffer: the newest history iteration of a prompt key (tokens)."""

from __future__ import annotations

from collections.abc import Sequence

from seer.v1 import buffer_pb2, buffer_pb2_grpc

from services.common.errors import ResourceExhausted
from services.common.grpcutil import channel
from services.draft.backfill import BufferIteration


class HistoryOmitted(ResourceExhausted):
    """The buffer left the asked key out of its GetHistory reply (`omitted_prompt_keys`: the reply
    was over its size bound). Not "no history": HistoryBackfill logs it and asks again later."""


class BufferHistoryLink:
    """GetHistory(include_tokens) over one long-lived channel; errors propagate as grpc.RpcError,
    or HistoryOmitted (HistoryBackfill logs them and asks again later)."""

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
        the draft server seeds it as); no responses when the buffer has none. HistoryOmitted when
        the reply names the key in `omitted_prompt_keys` instead: the buffer omits whole keys only
        after an earlier key of the same reply, so with one key a call it does not happen today,
        but read as "no history" it would be a silent loss of the key's refill (a link asking
        several keys a call, a buffer whose bound changed)."""
        resp = self._stub.GetHistory(buffer_pb2.GetHistoryRequest(prompt_keys=[prompt_key], include_tokens=True),
                                     timeout=self._timeout_s)
        for h in resp.histories:
            if h.prompt_key == prompt_key:
                return BufferIteration(h.policy_version, [list(r.token_ids) for r in h.responses])
        if prompt_key in resp.omitted_prompt_keys:
            raise HistoryOmitted("left out of the buffer's GetHistory reply (omitted_prompt_keys, over its "
                                 "reply bound): its history is unknown, not empty", field="prompt_keys[0]")
        return BufferIteration(0, [])

    def close(self) -> None:
        self._channel.close()

