"""Benchmarks (not tests): each writes bench/results/NAME.json and NAME.md."""
import os
import platform


def machine() -> str:
    """What a result was measured on: the CPU's model (Linux: /proc/cpuinfo; `platform.processor()` is empty
    there), its architecture and core count."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{model or platform.processor() or 'unknown CPU'}, {platform.machine()}, {os.cpu_count()} cores"
