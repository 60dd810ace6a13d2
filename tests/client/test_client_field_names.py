"""SubmitBatch errors name the client's fields, not the proto's (real buffer on loopback). The buffer
names SubmitBatchRequest's fields: a PromptGroup's `prompt` is prompt_token_ids or prompt_text
there, and its error for an out-of-vocabulary id said `groups[0].prompt_token_ids[0]` where the
client's own check of the same list says `groups[0].prompt[0]`. And `groups` that is not a sequence
of groups (a single PromptGroup, the usual slip) raised a bare TypeError."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from client_helpers import Buffer
from seer_client import PromptGroup, Sampling, SeerClient, SeerError

OK = PromptGroup(prompt=[1, 2], group_size=1, max_tokens=4)


def _refused(buffer: Buffer, groups: object, batch_id: str = "bad") -> SeerError:
    with SeerClient(buffer.address) as c:
        with pytest.raises(SeerError) as e:
            c.submit_batch(batch_id, groups)  # type: ignore[arg-type]
        # Nothing stored either way (the buffer refuses the whole batch).
        with pytest.raises(SeerError) as missing:
            c.get_batch(batch_id)
        assert missing.value.code == "NOT_FOUND"
    return e.value


@pytest.mark.parametrize("group, code, message", [
    # Before: "groups[1].prompt_token_ids[1]: token id 1000000 outside the vocabulary [0, 49152)".
    (PromptGroup(prompt=[1, 1_000_000], group_size=1, max_tokens=4), "INVALID_ARGUMENT",
     "groups[1].prompt[1]: token id 1000000 outside the vocabulary [0, 49152)"),
    # Before: "groups[1].prompt_text: this buffer has no tokenizer ..." (the fixture's buffer has none).
    (PromptGroup(prompt="2+3=", group_size=1, max_tokens=4), "FAILED_PRECONDITION",
     "groups[1].prompt: this buffer has no tokenizer"),
    # Fields the client and the proto name alike come through unchanged.
    (PromptGroup(prompt=[1], group_size=1, max_tokens=4, sampling=Sampling(stop_token_ids=[49152])),
     "INVALID_ARGUMENT", "groups[1].sampling.stop_token_ids[0]: token id 49152 outside the vocabulary"),
    (PromptGroup(prompt=[1], group_size=1, max_tokens=10**9), "INVALID_ARGUMENT", "groups[1].max_tokens: "),
])
def test_a_buffer_error_names_the_client_field(buffer: Buffer, group: PromptGroup, code: str, message: str) -> None:
    err = _refused(buffer, [OK, group])
    assert err.code == code and err.message.startswith(message), err


@pytest.mark.parametrize("prompt", ["", [], ()])
def test_an_empty_prompt_is_refused_by_the_client(buffer: Buffer, prompt: object) -> None:
    """Sent, it was refused in the proto's words ("groups[0].prompt_token_ids: empty prompt: give
    prompt_token_ids or prompt_text")."""
    err = _refused(buffer, [OK, PromptGroup(prompt=prompt, group_size=1, max_tokens=4)])  # type: ignore[arg-type]
    assert err.code == "INVALID_ARGUMENT" and err.message.startswith("groups[1].prompt: must not be empty"), err


@pytest.mark.parametrize("groups, named", [
    (OK, "got PromptGroup (wrap a single group in a list: [group])"),  # before: TypeError, not iterable
    (None, "got NoneType"),
    (5, "got int"),
    ("text", "got str"),  # before: iterated by character, "groups[0]: must be a PromptGroup, got str"
    ({"a": OK}, "got dict"),
])
def test_groups_that_are_not_a_sequence_of_groups(buffer: Buffer, groups: object, named: str) -> None:
    err = _refused(buffer, groups)
    assert err.code == "INVALID_ARGUMENT"
    assert err.message == f"groups: must be a sequence of PromptGroup, {named}", err


def test_any_iterable_of_groups_still_goes(buffer: Buffer) -> None:
    def gen() -> Iterator[PromptGroup]:
        yield OK

    with SeerClient(buffer.address) as c:
        assert c.submit_batch("gen", gen()).num_requests == 1
        assert c.submit_batch("tup", (OK, OK)).num_requests == 2
