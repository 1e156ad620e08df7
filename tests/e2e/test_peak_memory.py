"""An in-memory data set costs one copy of itself: ``data=synthetic`` builds its samples in
place, where ``prototypes[y] + noise * randn`` held three copies at the peak (the largest
process's memory is what limits how many jobs fit on a machine at once)."""

from __future__ import annotations

import json
import subprocess
import sys

PEAK = """
import json, resource
import torch
from ddpexp.data import Synthetic
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
splits = Synthetic(num_samples=20000, val_samples=16, test_samples=16, shape=[3, 32, 32],
                   num_classes=10).load()
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"grew": (after - before) * 1024, "data": sum(s.x.nbytes for s in splits)}))
"""


def test_synthetic_peak_memory_is_one_copy_of_the_data() -> None:
    # A fresh process, so that the high-water mark is this load's and no earlier test's.
    out = subprocess.run([sys.executable, "-c", PEAK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    assert figures["data"] > 200 * 2**20  # large enough to dwarf allocator noise
    assert figures["grew"] < 1.4 * figures["data"], figures
