"""Processes and the machine they run on, as the processes that share a database or a model
cache tell each other's apart: which of them may be gone, and which cannot be judged from here."""

from __future__ import annotations

import os
import socket

# The Linux kernel's fixed inode for the machine's own pid namespace (PROC_PID_INIT_INO).
MACHINE_PID_NAMESPACE = "pid:[4026531836]"


def this_host() -> str:
    """The host name, followed on Linux by the pid namespace when it is not the machine's own.
    Containers that share the host's network share its name but not its pids: without the
    namespace a worker in one would look up another's pid in its own table, find it dead and
    take over items that are still running."""
    name = socket.gethostname()
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:  # no /proc (macOS)
        return name
    return name if namespace == MACHINE_PID_NAMESPACE else f"{name} {namespace}"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host (and pid namespace) runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
