"""How much host memory this process may still take: the machine's available memory, or less where a
memory cgroup of the process (a container, a Slurm job) caps it lower."""

from __future__ import annotations

from pathlib import Path

import psutil


def available_host_memory(cgroup_root: str = "/sys/fs/cgroup", own_cgroup: str = "/proc/self/cgroup") -> int:
    """Bytes the system can still give this process: ``psutil``'s estimate of available memory, or less
    where a cgroup of the process (a container, a Slurm job) caps it lower."""
    rooms = [cap - used for cap, used in _cgroup_limits(Path(cgroup_root), Path(own_cgroup))]
    return min([int(psutil.virtual_memory().available), *rooms])


def host_memory_limit(cgroup_root: str = "/sys/fs/cgroup", own_cgroup: str = "/proc/self/cgroup") -> int:
    """The most host memory this process may use: the machine's, or the lowest cgroup limit above it."""
    caps = [cap for cap, _ in _cgroup_limits(Path(cgroup_root), Path(own_cgroup))]
    return min([int(psutil.virtual_memory().total), *caps])


_LAYOUTS = (
    ("memory.max", "memory.current", "memory.stat", "inactive_file"),  # cgroup v2
    ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat", "total_inactive_file"),  # v1
)


def _cgroup_limits(root: Path, own_cgroup: Path) -> list[tuple[int, int]]:
    """(limit, working set) of every memory cgroup that limits this process: the namespace's root, and
    the process's own group and its ancestors (a Slurm job's limit sits on ``job_N``, above the step's
    group). The working set is usage less the inactive file cache, which the kernel reclaims before it
    kills anything: the figure its OOM killer and kubelet go by."""
    groups = [root, root / "memory"]
    try:
        for line in own_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            base = root if controllers == "" else root / "memory" if "memory" in controllers.split(",") else None
            parts = [part for part in path.strip().split("/") if part]
            if base is not None:
                groups += [base.joinpath(*parts[:n]) for n in range(len(parts), 0, -1)]
    except (OSError, ValueError):
        pass
    limits, seen = [], set()
    for group in groups:
        for limit, usage, stat, inactive in _LAYOUTS:
            if (group / limit) in seen:
                continue
            seen.add(group / limit)
            try:
                cap = (group / limit).read_text().strip()
                used = int((group / usage).read_text())
            except (OSError, ValueError):
                continue
            if cap == "max" or int(cap) >= 1 << 60:  # v2 and v1 spell "no limit" differently
                continue
            cache = 0
            try:
                for entry in (group / stat).read_text().splitlines():
                    name, _, value = entry.partition(" ")
                    if name == inactive:
                        cache = int(value)
            except (OSError, ValueError):
                pass
            limits.append((int(cap), max(0, used - cache)))
    return limits
