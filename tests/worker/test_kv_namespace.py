"""The KV namespace (the engine's model version string) names the weights, not just the policy
version: a new training run on the same kvstore volume restarts at v0, and a LoadWeights may reload
a version from another source. Such weights must never share a namespace (or page hashes) with
others, and the store's version ordering must not refuse them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from worker_fake_engine import FakeEngine

from services.common.kvlayout import KVLayout
from services.common.pagehash import chain_hashes
from services.kvstore.checksum import page_checksum
from services.kvstore.store import KvStore, family_of, version_of
from services.worker.core import Worker, version_name, weights_id

LAYOUT = KVLayout(dtype="float32", page_size=4, num_layers=2, num_kv_heads=1, head_dim=8)


def _ckpt(path: Path, content: bytes) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors").write_bytes(content)
    return str(path)


@pytest.fixture
def worker() -> Any:
    w = Worker(FakeEngine(), speculation=False, model_family="m").start()
    yield w
    w.close()


def test_version_name_keeps_the_version_tail() -> None:
    assert version_name(3) == "v3" and version_name(3, "m") == "m@v3"
    name = version_name(3, "m", "abc123")
    assert name == "m@abc123@v3"
    # The store orders by the tail and groups by everything before it; engines parse the tail.
    assert family_of(name) == "m@abc123" and version_of(name) == 3


def test_other_checkpoints_get_other_namespaces(worker: Worker, tmp_path: Path) -> None:
    a = _ckpt(tmp_path / "run1" / "step1", b"weights A")
    b = _ckpt(tmp_path / "run2" / "step1", b"weights B")
    worker.load_weights(1, a)
    ns_a = worker.engine.model_version
    worker.load_weights(1, b)  # same version, another source: must not keep the namespace
    ns_b = worker.engine.model_version
    assert ns_a != ns_b and ns_a.endswith("@v1") and ns_b.endswith("@v1")
    worker.load_weights(2, None)  # a reload without a source reloads b: still named by b
    assert family_of(worker.engine.model_version) == family_of(ns_b)


def test_checkpoint_rewritten_in_place_gets_another_id(tmp_path: Path) -> None:
    src = _ckpt(tmp_path / "latest", b"weights A")
    first = weights_id(src)
    assert weights_id(src) == first  # stable for unchanged files
    (tmp_path / "latest" / "model.safetensors").write_bytes(b"weights B, longer")
    os.utime(tmp_path / "latest" / "model.safetensors", ns=(1, 1))
    assert weights_id(src) != first
    assert weights_id("hub/model-name") == weights_id("hub/model-name")  # not a path: the name alone


def test_checkpoints_that_differ_away_from_the_middle_get_other_ids(tmp_path: Path) -> None:
    """Training that reached only the last tenth of a file (the rest frozen): one 64 KiB sample
    from the middle gave both checkpoints one id, hence one KV namespace (found by review,
    session 18)."""
    frozen = os.urandom(900_000)
    a = _ckpt(tmp_path / "a", frozen + os.urandom(100_000))
    b = _ckpt(tmp_path / "b", frozen + os.urandom(100_000))
    assert weights_id(a) != weights_id(b)


def test_the_same_checkpoint_elsewhere_has_the_same_id(tmp_path: Path) -> None:
    # Workers on other nodes load their own copies (other paths, other mtimes): they must agree on
    # the namespace, or none could use another's KV.
    a = _ckpt(tmp_path / "node1" / "ckpt", b"x" * 200_000)
    b = _ckpt(tmp_path / "node2" / "copy", b"x" * 200_000)
    os.utime(Path(b) / "model.safetensors", ns=(1, 1))
    assert weights_id(a) == weights_id(b)
    c = _ckpt(tmp_path / "node3" / "other", b"x" * 100_000 + b"y" * 100_000)  # same size, other weights
    assert weights_id(c) != weights_id(a)


def test_new_training_run_on_the_same_volume(tmp_path: Path) -> None:
    """The reviewer's r9: run 2 restarts at v0 on run 1's store. Its Puts are accepted and it is
    never served run 1's pages for the same tokens."""
    tokens = [1, 2, 3, 4]
    store = KvStore(str(tmp_path / "kv"), dram_bytes=64 * LAYOUT.page_bytes, ssd_bytes=1 << 20, min_blob_bytes=256)
    run1 = [version_name(v, "m", weights_id(_ckpt(tmp_path / "run1" / f"s{v}", b"r1-%d" % v))) for v in (1, 2)]
    for name in run1:
        data = os.urandom(LAYOUT.page_bytes)
        store.put(name, LAYOUT, chain_hashes(tokens, 4, name)[0], data, page_checksum(data), "run1")
    store.close()
    store = KvStore(str(tmp_path / "kv"), dram_bytes=64 * LAYOUT.page_bytes, ssd_bytes=1 << 20, min_blob_bytes=256)
    try:
        run2 = [version_name(v, "m", weights_id(_ckpt(tmp_path / "run2" / f"s{v}", b"r2-%d" % v))) for v in (1, 2)]
        assert not set(run1) & set(run2)
        for name in run2:
            h = chain_hashes(tokens, 4, name)[0]
            assert store.exists(name, [h]) == 0  # run 1's KV for these tokens is not offered
            data = os.urandom(LAYOUT.page_bytes)
            assert store.put(name, LAYOUT, h, data, page_checksum(data), "run2")  # not refused
    finally:
        store.close()


def test_sglang_family_takes_the_weights_id_without_a_second_at() -> None:
    from services.worker.engines.sglang import pages
    from services.worker.engines.sglang.engine import _family_of

    fam = _family_of(version_name(0, "m", "abc123"))
    assert fam == "m-abc123" and _family_of("m@v3") == "m" and _family_of("v3") == "model"
    assert pages.namespace(fam, 1) == "sglang-m-abc123-tp0of1@v1"  # the store's "@v<N>" tail, one "@"
