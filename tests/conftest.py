"""Suite-wide setup: the objects that exist once the tests are collected (torch, the imported frameworks, the test
modules) are left out of the garbage collector's scans (``gc.freeze``). They are never garbage, and each memory
measurement runs a full collection (``ctx_plugin.memory.measure``), which otherwise scans them every time: about
0.1-0.3 s a collection here, twice that on 2 cores."""
from __future__ import annotations

import gc


def pytest_collection_finish(session) -> None:
    gc.collect()
    gc.freeze()
