"""Suite-wide setup.

- The objects that exist once the tests are collected (torch, the imported frameworks, the test modules) are left
  out of the garbage collector's scans (``gc.freeze``). They are never garbage, and each memory measurement runs a
  full collection (``ctx_plugin.memory.measure``), which otherwise scans them every time: about 0.1-0.3 s a
  collection here, twice that on 2 cores.
- The compiled-model tests (tests/distributed/test_compile.py, DeepSpeed's ``engine.compile()`` cases) write
  inductor's C++ and kernel cache under this run's pytest temporary directory, which pytest prunes (it keeps the
  last three runs), instead of /tmp/torchinductor_<user>, which grows by ~150 MB each time the code changes and
  is never pruned: on a shared CI disk that was enough to fill it. A cache dir the user set is kept.
"""
from __future__ import annotations

import gc
import os

import pytest

_CACHES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


@pytest.fixture(scope="session", autouse=True)
def _compiler_cache_in_pytest_tmp(tmp_path_factory):
    base = tmp_path_factory.mktemp("compiler-cache", numbered=False)
    set_here = [name for name in _CACHES if not os.environ.get(name)]
    for name in set_here:
        os.environ[name] = str(base / name.split("_")[0].lower())
    yield
    for name in set_here:
        os.environ.pop(name, None)


def pytest_collection_finish(session) -> None:
    gc.collect()
    gc.freeze()
