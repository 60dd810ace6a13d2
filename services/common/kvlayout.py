"""KV page layout: the shape and dtype of one exported KV page, shared by the engines (which export
and import pages) and the kvstore (which keys namespaces on it), so both agree on one definition.

In the kvstore, the first Put into a namespace fixes its layout; every later Put (and a Get that states a layout)
is checked field by field, and a disagreement names the field (`layout.num_kv_heads`), so a worker
with a different model config or dtype can never store or read pages that would decode as garbage.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

from services.common.errors import InvalidArgument

# Bytes per element of the dtypes engines export (numpy does not know bfloat16).
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True)
class KVLayout:
    dtype: str  # "float32", "bfloat16", ... (a key of DTYPE_BYTES)
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str = "layer,kv,token,head,dim"

    @property
    def page_bytes(self) -> int:
        # K and V for every layer: [num_layers, 2, page_size, num_kv_heads, head_dim] elements.
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def validate(self, prefix: str = "layout") -> None:
        if self.dtype not in DTYPE_BYTES:
            raise InvalidArgument(
                f"unknown dtype {self.dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}", field=f"{prefix}.dtype"
            )
        for name in ("page_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if value <= 0:
                raise InvalidArgument(f"must be > 0, got {value}", field=f"{prefix}.{name}")

    def check_same(self, other: KVLayout, prefix: str = "layout") -> None:
        """Raises InvalidArgument naming the first field where `other` disagrees with self."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                raise InvalidArgument(f"{theirs!r} disagrees with the namespace's {mine!r}", field=f"{prefix}.{f.name}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> KVLayout:
        return KVLayout(**json.loads(text))
