"""The wake-ups of a shared budget's members: an abstract Unix datagram socket per member,
which an asker (or `vattn budget set-limit`) sends a byte to so that the member's responder
reads its row now rather than at its next poll (`POLL_S`). Only wake-ups from processes
that may join the budget count (`drain`)."""
from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading

from vattn.budget.shared.directory import Place


def wake_address(pid: int, nonce: int) -> str:
    return f"\0vattn-budget-{pid}-{nonce:x}"  # abstract: no file, gone with the process


_sender: socket.socket | None = None
_sender_lock = threading.Lock()


def wake_members(pids_nonces: list[tuple[int, int]]) -> None:
    """Wake the responders of these members now (best effort: they poll anyway)."""
    global _sender
    if not pids_nonces:
        return
    with _sender_lock:
        if _sender is None:
            _sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            _sender.setblocking(False)
        for pid, nonce in pids_nonces:
            try:
                _sender.sendto(b"!", wake_address(pid, nonce))
            except OSError:  # gone, its queue full, or another network namespace
                pass


def listen(nonce: int) -> socket.socket | None:
    """This member's wake-up socket (None where there are no abstract sockets: it polls).
    Any local process can send to an abstract socket: the kernel tells who sent each
    wake-up (SO_PASSCRED), and `drain` drops those of processes that may not join."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(wake_address(os.getpid(), nonce))
    except OSError:  # no abstract sockets here: the responder polls
        sock.close()
        return None
    with contextlib.suppress(AttributeError, OSError):  # Linux; elsewhere every wake-up counts
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    sock.setblocking(False)
    return sock


_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid


def drain(sock: socket.socket, where: Place) -> bool:
    """Read the wake-ups waiting (64 at most: askers may keep sending). True when one came
    from a process that may join the budget (a sender the kernel does not name counts)."""
    woken = False
    for _ in range(64):
        try:
            _, ancillary, _, _ = sock.recvmsg(16, socket.CMSG_SPACE(_UCRED.size))
        except (BlockingIOError, InterruptedError):
            break
        uid = None
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == getattr(socket, "SCM_CREDENTIALS", -1) and \
                    len(data) >= _UCRED.size:
                uid = _UCRED.unpack_from(data)[1]
        woken = woken or uid is None or where.trusts(uid)
    return woken


def close_sender() -> None:
    """At exit: close the socket `wake_members` sends from."""
    global _sender
    with _sender_lock:
        if _sender is not None:
            _sender.close()
            _sender = None


def forget_sender() -> None:
    """In a forked child: the parent's sending socket and its lock are not the child's."""
    global _sender, _sender_lock
    _sender, _sender_lock = None, threading.Lock()
