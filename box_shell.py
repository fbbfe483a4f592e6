"""The ``$SHELL`` of a ``no-network`` agent box: runs ``/bin/bash ARGS`` with the network cut off
by the kernel, for that command and everything it starts.

    python box_shell.py -c 'curl example.com'      # what OpenCode's bash tool runs as $SHELL -c …

A seccomp filter (installed with no privileges: ``PR_SET_NO_NEW_PRIVS``, then
``PR_SET_SECCOMP``) refuses ``socket()`` for the IPv4, IPv6 and packet families with ``EACCES``,
and ``io_uring_setup`` (whose socket operation would go around it); a syscall of another ABI
(x32, i386) ends the process. Unix sockets stay (a pipe to a local tool is no network). Why not a
network namespace per command: making one needs privileges a box with its capabilities dropped no
longer has (a root worker's box), and the filter costs no namespace per command.

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
    libc = ctypes.CDLL(None, use_errno=True)
    for args in ((38, 1, 0, 0, 0), (22, 2, ctypes.addressof(prog), 0, 0)):   # NO_NEW_PRIVS, SECCOMP filter
        if libc.prctl(*[ctypes.c_ulong(a) for a in args]) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def main(argv: list[str]) -> int:
    try:
        cut_network()
    except (OSError, RuntimeError) as exc:   # fail closed: no command runs with the network
        print(f"TaskBridge no-network: the network could not be cut off ({exc}); command not run",
              file=sys.stderr)
        return 126
    os.environ["SHELL"] = "/bin/bash"
    os.execv("/bin/bash", ["bash", *argv])
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
