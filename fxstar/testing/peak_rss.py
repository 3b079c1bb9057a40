"""How far this process's resident memory rises during a piece of work (Linux): the check
that a load or an export streams a model instead of holding a copy of it."""

from __future__ import annotations

import resource

__all__ = ["peak_rss", "reset_peak_rss", "rss"]


def rss() -> int:
    """Resident bytes now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss() -> int:
    """The most resident bytes since the process started, or since `reset_peak_rss`."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Restart the high-water mark at the resident bytes now (Linux >= 4.0); False where the
    kernel refuses, and the peak then counts from the process's start."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True
