"""common/cpu_memory.py: with freed memory kept, an update-like loop of big allocations stops
faulting its pages in again (measured in fresh processes, the allocator's settings are per process)."""
import subprocess
import sys
from pathlib import Path

import pytest

LOOP = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from common.cpu_memory import keep_freed_memory
    assert keep_freed_memory()
torch.ones(1).add_(1)  # torch's own start-up allocations happen before the count
rounds = []
for _ in range(16):  # the kept heap can take 4 rounds to settle (fragmentation), the default never does
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensors = [torch.ones(n) for n in (16 << 20, 14 << 20, 3 << 20)]  # 64, 56 and 12 MB, then freed
    del tensors
    rounds.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(rounds[-3:]))  # steady state: the first rounds fault while the heap grows to its peak
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", LOOP, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def huge_pages_always() -> bool:
    try:
        return "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.skipif(huge_pages_always(), reason="2 MB pages for every mapping: too few faults to compare")
def test_kept_memory_is_reused_without_page_faults():
    default, kept = faults("default"), faults("keep")
    assert default > 3 * 30000  # three rounds of 120-132 MB given back to the kernel and faulted in again (4 KiB pages)
    assert kept < default / 20
