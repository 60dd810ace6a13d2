"""The SGLang backend (GPU production engine). Every module here imports sglang lazily or only when
SGLang itself loads it, so this package is importable (and its conversions testable) without sglang.

    engine.py   SGLangEngine: the Engine interface over SGLang's streaming requests
    plugin.py   the SEER speculative algorithm (entry point sglang.srt.plugins): grouped drafts
    storage.py  SeerHiCacheStorage: HiCache L3 backed by the Seer KV store (--hicache-storage-backend dynamic)
    drafts.py   draft tree <-> NGRAM block (root, BFS order, padding, ancestor mask); pure
    pages.py    HiCache key -> (namespace, page hash), the version file; pure
"""
