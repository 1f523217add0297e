"""Processes and the machine they run on, as the processes that share a database or a model
cache tell each other's apart: which of them may be gone, and which cannot be judged from here."""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys

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


def this_host_and_boot() -> str:
    """:func:`this_host` and the machine's current boot, as a worker names itself in the
    database and in RQ's record of it: two machines may share a host name (laptops keep their
    default names, cloned VMs their image's), and without the boot a worker on one would look
    up the other's pid in its own table, find it dead and take over an item still decoding
    there. A boot stands for the machine where a pid means something; after a reboot the
    earlier boot's items are another machine's, left to their lease."""
    boot = boot_id()
    return f"{this_host()} boot {boot}" if boot else this_host()


@functools.cache
def boot_id() -> str | None:
    """A short id of this machine's current boot, which containers share with their host:
    macOS's boot session's, the kernel's on Linux; None where it cannot be read (the host name
    alone then tells machines apart, as before boots were counted)."""
    try:
        if sys.platform == "darwin":
            raw = subprocess.run(["/usr/sbin/sysctl", "-n", "kern.bootsessionuuid"], capture_output=True, text=True,
                                 timeout=5, check=True).stdout
        else:
            with open("/proc/sys/kernel/random/boot_id") as source:
                raw = source.read()
    except (OSError, subprocess.SubprocessError):
        return None
    return raw.strip().replace("-", "").lower()[:12] or None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host (and pid namespace) runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
