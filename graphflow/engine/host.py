"""The host's free memory, read from the kernel rather than through torch.

Its own module, below ``backend`` and ``memory`` both: the CPU backend reports it as a
device's free memory, and ``graphflow run`` checks a plan against it before torch is
imported, so it may import neither torch nor the engine's context.
"""

from __future__ import annotations

__all__ = ["host_available"]


def host_available() -> int | None:
    """The host memory a new allocation can take (Linux's MemAvailable), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
