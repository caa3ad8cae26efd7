"""How many data-plane workers `run` starts by default: the CPUs this process may really use."""

from __future__ import annotations

import math
import os


def default_worker_count() -> int:
    """CPUs this process may really use: the affinity mask, capped by a cgroup CPU quota.

    `os.cpu_count()` reports the host's cores; in a container limited to 2 CPUs on a 64-core node that would
    start 64 workers fighting over 2 CPUs of quota. Kubernetes expresses CPU limits as a CFS quota, so read
    it (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`/`cpu.cfs_period_us`) and round up.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def _cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    try:
        with open(os.path.join(root, "cpu.max"), encoding="ascii") as fh:
            limit, per = fh.read().split()[:2]
        return None if limit == "max" else int(limit) / int(per)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us"), encoding="ascii") as fh:
            quota = int(fh.read().strip())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us"), encoding="ascii") as fh:
            period = int(fh.read().strip())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None
