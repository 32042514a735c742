"""ctx_plugin.memory.measure's storage tracker: an ignored storage that dies does not hide the storages created after
it (the allocator hands a new storage object the dead one's address straight away)."""
from __future__ import annotations

import torch

from ctx_plugin.memory.measure import _StorageTracker


def test_ignored_storage_that_dies_hides_no_later_storage():
    tracker = _StorageTracker(follow_peak=True)
    kept = []
    with tracker:
        for _ in range(20):
            host = torch.empty(1000)
            tracker.ignore_storage(host)
            del host                                   # its address is free for the next storage object
            kept.append(torch.ones(250))               # 1,000 bytes each, all alive to the end
    assert tracker.live() == 20 * 1000


def test_ignore_drops_a_storage_already_counted():
    tracker = _StorageTracker()
    with tracker:
        t = torch.ones(100)
        assert tracker.live() == 400
        tracker.ignore_storage(t)
        u = torch.zeros(10)
    assert tracker.live() == 40 and u.numel() == 10 and t.numel() == 100

