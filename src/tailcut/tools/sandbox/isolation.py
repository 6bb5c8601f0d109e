"""The isolation report of one local sandbox run (:attr:`SandboxResult.isolation`): what
was isolated or limited and how, in words; what was not starts with ``NOT isolated``
and is logged once per process."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tailcut.tools.sandbox.cgroup import RunCgroup
    from tailcut.tools.sandbox.config import SandboxConfig

log = logging.getLogger(__name__)

NAMESPACE_LABELS = (("net", "network"), ("pid", "processes"), ("mount", "mounts"), ("ipc", "ipc"))
_warned: set[str] = set()


def isolation_report(
    cfg: SandboxConfig, notes: dict[str, Any], cgroup: RunCgroup | None
) -> dict[str, str]:
    """Describe a run from its supervisor's ``notes`` (what it could set up) and its cgroup."""
    out: dict[str, str] = {}
    uid = notes.get("uid")
    if uid is not None:
        out["user"] = f"uid {uid}"
    elif os.geteuid() == 0:
        out["user"] = "root without capabilities: " + notes.get("uid_refused", "no uid")
    else:
        out["user"] = f"uid {os.getuid()} (unchanged)"
    for name, label in NAMESPACE_LABELS:
        value = notes.get(name)
        if not cfg.use_namespaces or (name == "net" and not cfg.isolate_network):
            out[label] = "NOT isolated: switched off in the sandbox config"
        else:
            out[label] = "namespace" if value is True else f"NOT isolated: {value}"
    out["filesystem"] = notes.get("filesystem", "shared (no mount namespace)")
    if notes.get("disk") is True:
        out["disk"] = f"tmpfs quota {cfg.disk_mb} MiB (work dir and private /tmp)"
    else:
        why = out["mounts"].removeprefix("NOT isolated: ")
        out["disk"] = f"NOT isolated: {why}; only {cfg.max_file_mb} MiB per file"
    if (pids := cgroup and cgroup.path_of("pids")) is not None:
        out["process_limit"] = f"pids cgroup ({pids})"
    else:
        out["process_limit"] = "RLIMIT_NPROC" + (f" for uid {uid}" if uid is not None else "")
    per_process = f"{cfg.memory_mb} MiB per process (RLIMIT_AS)"
    if (memory := cgroup and cgroup.path_of("memory")) is not None:
        out["memory_limit"] = (f"{cfg.run_memory_mb} MiB for the whole run, its tmpfs files "
                               f"included (memory cgroup {memory}); {per_process}")  # fmt: skip
    else:
        out["memory_limit"] = f"NOT isolated: no memory cgroup, only {per_process}"
    for label, value in out.items():
        if "NOT isolated" in value and label not in _warned:
            _warned.add(label)
            log.warning("local sandbox: %s %s", label, value)
    return out
