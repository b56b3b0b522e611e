"""Benchmarks (not tests): each writes bench/results/NAME.json and NAME.md."""


def peak_rss_bytes() -> int:
    """This process's peak RSS (VmHWM, Linux), for a probe run in a process of its own. Not getrusage's
    ru_maxrss: Linux keeps it across exec, so a probe's figure had its parent's RSS at the fork as a floor
    (a benchmark 800 MB large: 813 MB for a child whose own peak is 14 MB)."""
    from pathlib import Path
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
