"""A malformed item of a tuple field names its key once (the item's error was wrapped again)."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError, load
from services.draft.config import DraftConfig


def test_a_bad_tuple_item_names_the_key_once() -> None:
    with pytest.raises(ConfigError) as e:
        load(DraftConfig, "draft", argv=[], env={"SEER_DRAFT_LEVELS": "1,x"})
    assert str(e.value) == "draft:levels: invalid literal for int() with base 10: 'x'"
