"""Per-run cgroups of the local sandbox: a process cap (``pids``) and a memory cap for
the whole run (``memory``), cgroup v1 or v2, wherever the hierarchy is writable.

cgroup v1 mounts one hierarchy per controller, so a run gets a directory in each (its
supervisor joins all of them); v2 has one hierarchy, so a run gets one directory with
both controllers. Each is ``<our own cgroup>/tailcut-sandbox/run-<owner mark>-<tag>``:
the name carries the owner's pid and start time (:func:`~.procs.owner_mark`), so creating
one sweeps the cgroups of owners that were killed, and kills what is left in them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

from tailcut.tools.sandbox.procs import kill_and_wait, owner_is_dead

log = logging.getLogger(__name__)

PARENT = "tailcut-sandbox"
CONTROLLERS = ("pids", "memory")


def own_cgroup_dirs() -> dict[Path, tuple[int, set[str]]]:
    """Our own cgroup directory in each mounted hierarchy that offers ``pids`` or
    ``memory`` to sub-cgroups: ``{dir: (version, controllers)}``."""
    v1: dict[str, Path] = {}
    v2: Path | None = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _, options = right.split()[:3]
            point = Path(left.split()[4])
            if fstype == "cgroup2":
                v2 = v2 or point
            elif fstype == "cgroup":
                v1.update((c, point) for c in CONTROLLERS if c in options.split(","))
    with open("/proc/self/cgroup") as f:
        lines = [ln.rstrip("\n").split(":", 2) for ln in f]
    found: dict[Path, tuple[int, set[str]]] = {}
    for hier, controllers, rel in lines:
        v1_here = set(controllers.split(",")) & v1.keys() if hier != "0" else set()
        for c in v1_here:
            found.setdefault(v1[c] / rel.lstrip("/"), (1, set()))[1].add(c)
    rest = set(CONTROLLERS) - {c for _v, cs in found.values() for c in cs}
    for hier, _controllers, rel in lines:
        if hier == "0" and v2 is not None and rest:
            base = v2 / rel.lstrip("/")
            enabled = rest & set((base / "cgroup.subtree_control").read_text().split())
            if enabled:
                found[base] = (2, enabled)
    return found


def _limit_files(controller: str, version: int) -> list[str]:
    """The files that cap ``controller``: the first is required, the others (swap caps,
    written 0 on v2 and equal to the memory cap on v1) only where the kernel has them."""
    if controller == "pids":
        return ["pids.max"]
    if version == 2:
        return ["memory.max", "memory.swap.max"]
    return ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]


def _members(cgroup: Path) -> set[int]:
    try:
        return {int(x) for x in (cgroup / "cgroup.procs").read_text().split()}
    except OSError:
        return set()


class RunCgroup:
    """The cgroups of one run: each directory with the controllers that cap it there."""

    def __init__(self, dirs: dict[Path, tuple[int, set[str]]]):
        self.dirs = dirs

    @property
    def paths(self) -> list[Path]:
        return sorted(self.dirs)

    def path_of(self, controller: str) -> Path | None:
        return next((p for p, (_v, cs) in self.dirs.items() if controller in cs), None)

    @classmethod
    def create(cls, name: str, limits: dict[str, int]) -> RunCgroup | None:
        """New cgroups capped at ``limits`` (``{"pids": count, "memory": bytes}``); a
        controller whose hierarchy is absent or not writable is left out (None: all are)."""
        dirs: dict[Path, tuple[int, set[str]]] = {}
        try:
            hierarchies = own_cgroup_dirs()
        except OSError as exc:
            log.debug("no cgroup for the sandbox: %s", exc)
            return None
        for base, (version, controllers) in hierarchies.items():
            parent = base / PARENT
            try:
                parent.mkdir(exist_ok=True)
                _sweep(parent)
                (parent / name).mkdir()
            except OSError as exc:
                log.debug("no %s cgroup for the sandbox: %s", "/".join(controllers), exc)
                continue
            capped = {c for c in controllers if _cap(parent, name, c, version, limits[c])}
            if capped:
                dirs[parent / name] = (version, capped)
            else:
                with contextlib.suppress(OSError):
                    (parent / name).rmdir()
        return cls(dirs) if dirs else None

    def pids(self) -> set[int]:
        """Every process of the run (each directory holds them all)."""
        return _members(self.paths[0])

    def oom_kills(self) -> int:
        """How many of the run's processes the kernel killed at its memory cap."""
        path = self.path_of("memory")
        if path is None:
            return 0
        events = "memory.events" if self.dirs[path][0] == 2 else "memory.oom_control"
        with contextlib.suppress(OSError, ValueError):
            for line in (path / events).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def remove(self) -> bool:
        removed = True
        for path in self.paths:
            try:
                path.rmdir()
            except OSError:
                removed = False  # a zombie not yet reaped; swept by a later run
        return removed


def _cap(parent: Path, name: str, controller: str, version: int, limit: int) -> bool:
    """Enable ``controller`` for the run's cgroup ``parent/name`` and write its cap."""
    try:
        if version == 2:
            (parent / "cgroup.subtree_control").write_text(f"+{controller}")
        first, *optional = _limit_files(controller, version)
        (parent / name / first).write_text(str(limit))
        for file in optional:
            if (parent / name / file).exists():
                (parent / name / file).write_text(str(0 if version == 2 else limit))
        return True
    except OSError as exc:
        log.debug("no %s cgroup for the sandbox: %s", controller, exc)
        return False


def _sweep(parent: Path, min_age_s: float = 120.0) -> None:
    """Remove the cgroups of killed owners (after killing what is left in them) and
    empty ones that earlier runs could not remove (old ones only: a fresh empty one may
    belong to a run whose supervisor is about to join it)."""
    now = time.time()
    for child in parent.iterdir():
        with contextlib.suppress(OSError):
            if not child.is_dir():
                continue
            if owner_is_dead(child.name, "run-"):
                kill_and_wait(_members(child))
                child.rmdir()
            elif now - child.stat().st_mtime > min_age_s and not _members(child):
                child.rmdir()
