"""SeerClient's own input checks (real buffer): what protobuf would silently convert or refuse with a
bare ValueError/TypeError is a SeerError INVALID_ARGUMENT naming the field, raised before anything
is sent; what is fine (numpy/torch integers) still goes through unchanged."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from client_helpers import Buffer
from seer.v1 import buffer_pb2, buffer_pb2_grpc
from seer_client import PromptGroup, Sampling, SeerClient, SeerError


def _fed_prompts(address: str) -> dict[str, list[int]]:
    """The prompt token ids the buffer hands to a scheduler, by request id ({} if none)."""
    with grpc.insecure_channel(address) as ch:
        for ev in buffer_pb2_grpc.BufferInternalServiceStub(ch).WatchWork(
                buffer_pb2.WatchWorkRequest(watcher_id="probe"), timeout=3):
            if ev.HasField("added") and ev.added.items:
                return {it.request_id: list(it.prompt_token_ids) for it in ev.added.items}
    return {}


def _group(**kw: object) -> PromptGroup:
    args: dict[str, object] = {"prompt": [1, 2], "group_size": 1, "max_tokens": 4}
    args.update(kw)
    return PromptGroup(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("group, field", [
    # Before: int() truncated them and the buffer generated from [1, 2, 3].
    (_group(prompt=[1.9, 2.7, 3.5]), "groups[0].prompt[0]"),
    (_group(prompt=torch.tensor([1.0, 2.0])), "groups[0].prompt[0]"),
    # Before: bytes were iterated as byte values and sent as token ids [104, 101, ...].
    (_group(prompt=b"hello"), "groups[0].prompt"),
    (_group(prompt=bytearray(b"hi")), "groups[0].prompt"),
    (_group(prompt=7), "groups[0].prompt"),
    (_group(prompt=[1, True]), "groups[0].prompt[1]"),
    # Before: bare ValueError "Value out of range: -1" / TypeError, no field named.
    (_group(sampling=Sampling(seed=-1)), "groups[0].sampling.seed"),
    (_group(sampling=Sampling(seed=2**64)), "groups[0].sampling.seed"),
    (_group(group_size=2**31), "groups[0].group_size"),
    (_group(max_tokens=2**31), "groups[0].max_tokens"),
    (_group(max_tokens=4.0), "groups[0].max_tokens"),
    (_group(prompt=[1, 2**31]), "groups[0].prompt[1]"),
    (_group(sampling=Sampling(stop_token_ids=[2.5])), "groups[0].sampling.stop_token_ids[0]"),  # type: ignore[list-item]
    (_group(sampling=Sampling(top_k=2**31)), "groups[0].sampling.top_k"),
    (_group(sampling=Sampling(temperature="1.0")), "groups[0].sampling.temperature"),  # type: ignore[arg-type]
    (_group(labels={"answer": 5}), "groups[0].labels['answer']"),
    (_group(labels={5: "x"}), "groups[0].labels key"),
    (_group(prompt_key=3), "groups[0].prompt_key"),
    # Before: float32 made it 0.0 and the buffer ran the group greedy, silently.
    (_group(sampling=Sampling(temperature=1e-46)), "groups[0].sampling.temperature"),
    (_group(sampling=Sampling(temperature=1e-6)), "groups[0].sampling.temperature"),
])
def test_bad_input_is_a_seer_error_naming_the_field(buffer: Buffer, group: PromptGroup, field: str) -> None:
    with SeerClient(buffer.address) as c:
        with pytest.raises(SeerError) as e:
            c.submit_batch("bad", [_group(), group])  # the second group: the index is in the name
        assert e.value.code == "INVALID_ARGUMENT"
        assert e.value.message.startswith(field.replace("groups[0]", "groups[1]") + ":"), e.value.message
        # Nothing was sent: the batch does not exist.
        with pytest.raises(SeerError) as missing:
            c.get_batch("bad")
        assert missing.value.code == "NOT_FOUND"


def test_integer_types_of_numpy_and_torch_are_token_ids(buffer: Buffer) -> None:
    with SeerClient(buffer.address) as c:
        prompt = torch.tensor([5, 6, 7])
        # numpy and torch integers where the hints say int: what this test checks is accepted.
        group = PromptGroup(prompt=prompt, group_size=np.int64(1),  # type: ignore[arg-type]
                            max_tokens=np.int32(4),  # type: ignore[arg-type]
                            sampling=Sampling(seed=np.uint64(3)))  # type: ignore[arg-type]
        c.submit_batch("ints", [group])
    assert _fed_prompts(buffer.address) == {"ints/0/0": [5, 6, 7]}


def test_bad_cursor_and_version_name_the_argument(buffer: Buffer) -> None:
    with SeerClient(buffer.address) as c:
        c.submit_batch("b", [_group()])
        with pytest.raises(SeerError) as e:
            c.iter_results("b", cursor=-1)  # raised at the call, not at the first next()
        assert (e.value.code, e.value.message.split(":")[0]) == ("INVALID_ARGUMENT", "cursor")
        with pytest.raises(SeerError) as e:
            c.update_weights(2**63)
        assert (e.value.code, e.value.message.split(":")[0]) == ("INVALID_ARGUMENT", "version")
        with pytest.raises(SeerError) as e:
            c.update_weights(1.5)  # type: ignore[arg-type]
        assert e.value.message.split(":")[0] == "version"
