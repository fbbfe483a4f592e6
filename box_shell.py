"""The ``$SHELL`` of a boxed agent run: runs ``/bin/bash ARGS`` fenced off, by the kernel, from
the processes that are not its own, and for ``no-network`` from the network.

    python box_shell.py [--no-network] -c 'curl example.com'   # OpenCode's bash tool: $SHELL -c …

- Every command enters a Landlock domain of its own (``landlock_restrict_self``; no privileges
  needed): a process in it cannot ptrace, read the memory of, or open ``/proc/<pid>/fd/*`` of a
  process outside it, so the bash tool's commands cannot write into OpenCode's output (the event
  stream the worker meters), nor into the box's init, nor take over OpenCode's process.
- ``--no-network``: a seccomp filter refuses ``socket()`` for the IPv4, IPv6 and packet families
  with ``EACCES``, and ``io_uring_setup`` (whose socket operation would go around it); a syscall of
  another ABI (x32, i386) ends the process. Unix sockets stay (a pipe to a local tool is no
  network). Why not a network namespace per command: making one needs privileges a box with its
  capabilities dropped (a root worker's) no longer has.
Both are installed after ``PR_SET_NO_NEW_PRIVS`` and inherited by everything the command starts.
A kernel that refuses either: the command does not run (fail closed), unless Landlock is absent
altogether (``agent_box.support`` says so at start and the receipt labels it).

Used by agent_box.py (it writes the ``$SHELL`` that execs this file); not run on its own. Env:
none (the command's own environment passes through unchanged).
"""
from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys

# Linux's audit architecture and syscall numbers per machine.
_ARCH = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}
_IO_URING_SETUP = 425
_X32_BIT = 0x40000000
_REFUSED_FAMILIES = (2, 10, 17)     # AF_INET, AF_INET6, AF_PACKET
_EACCES = 13
_ALLOW, _ERRNO, _KILL = 0x7FFF0000, 0x00050000, 0x80000000
_LD, _JEQ, _JGE, _RET = 0x20, 0x15, 0x35, 0x06   # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K


def _filter(machine: str) -> bytes:
    """The classic-BPF program (struct sock_filter[]) refusing inet sockets on ``machine``."""
    arch, socket_nr = _ARCH[machine]
    deny = _ERRNO | _EACCES
    prog = [(_LD, 0, 0, 4),                      # seccomp_data.arch
            (_JEQ, 1, 0, arch),
            (_RET, 0, 0, _KILL),
            (_LD, 0, 0, 0),                      # seccomp_data.nr
            (_JGE, 0, 1, _X32_BIT),
            (_RET, 0, 0, _KILL),
            (_JEQ, 0, 1, _IO_URING_SETUP),
            (_RET, 0, 0, deny),
            (_JEQ, 1, 0, socket_nr),
            (_RET, 0, 0, _ALLOW),
            (_LD, 0, 0, 16)]                     # seccomp_data.args[0], low word (little-endian)
    for family in _REFUSED_FAMILIES:
        prog += [(_JEQ, 0, 1, family), (_RET, 0, 0, deny)]
    prog.append((_RET, 0, 0, _ALLOW))
    return b"".join(struct.pack("HBBI", *insn) for insn in prog)


_LANDLOCK_CREATE_RULESET, _LANDLOCK_RESTRICT_SELF = 444, 446   # the same on every Linux machine
_LANDLOCK_ACCESS_FS_MAKE_BLOCK = 1 << 11    # handled, never granted: a domain needs one right


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _no_new_privs(libc: ctypes.CDLL) -> None:
    if libc.prctl(ctypes.c_ulong(38), ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)):
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def landlock_version() -> int:
    """The kernel's Landlock ABI version, 0 when it has none (or it is disabled)."""
    got = _libc().syscall(ctypes.c_long(_LANDLOCK_CREATE_RULESET), ctypes.c_void_p(0), ctypes.c_size_t(0),
                          ctypes.c_uint32(1))
    return max(int(got), 0)


def scope_processes() -> None:
    """Enter a Landlock domain of one's own (see the module's docstring). Raises OSError."""
    libc = _libc()
    attr = ctypes.c_uint64(_LANDLOCK_ACCESS_FS_MAKE_BLOCK)
    fd = libc.syscall(ctypes.c_long(_LANDLOCK_CREATE_RULESET), ctypes.byref(attr), ctypes.c_size_t(8),
                      ctypes.c_uint32(0))
    if fd < 0:
        raise OSError(ctypes.get_errno(), f"landlock: {os.strerror(ctypes.get_errno())}")
    try:
        _no_new_privs(libc)
        if libc.syscall(ctypes.c_long(_LANDLOCK_RESTRICT_SELF), ctypes.c_int(fd), ctypes.c_uint32(0)):
            raise OSError(ctypes.get_errno(), f"landlock: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def cut_network() -> None:
    """Install the filter on this process (inherited by every child). Raises OSError when the
    kernel refuses it, and RuntimeError on a machine without a known syscall table."""
    machine = platform.machine()
    if machine not in _ARCH:
        raise RuntimeError(f"no seccomp filter for {machine}")
    code = _filter(machine)
    buf = ctypes.create_string_buffer(code)

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = Prog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    libc = _libc()
    _no_new_privs(libc)
    if libc.prctl(ctypes.c_ulong(22), ctypes.c_ulong(2), ctypes.c_ulong(ctypes.addressof(prog)),
                  ctypes.c_ulong(0), ctypes.c_ulong(0)):   # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def main(argv: list[str]) -> int:
    no_network = argv[:1] == ["--no-network"]
    argv = argv[1:] if no_network else argv
    try:
        if landlock_version():
            scope_processes()
        if no_network:
            cut_network()
    except (OSError, RuntimeError) as exc:   # fail closed: no command runs outside its fence
        print(f"TaskBridge's agent box: the shell could not be fenced in ({exc}); command not run", file=sys.stderr)
        return 126
    os.environ["SHELL"] = "/bin/bash"
    os.execv("/bin/bash", ["bash", *argv])
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
