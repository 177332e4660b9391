"""The socket a spawned job's rank 0 connects to: a unix socket in a fresh directory only this
user can enter, guarded by a random authkey (``multiprocessing.connection``'s challenge, both
ways); the first connection that proves the key is taken and the socket is closed and removed,
so nothing else can connect. ``Listener.accept`` cannot be bounded, hence this: the wait for
rank 0 polls, and the caller's ``check`` ends it (the job died, a deadline passed)."""
from __future__ import annotations

import logging
import os
import secrets
import select
import shutil
import socket
import tempfile
from multiprocessing.connection import AuthenticationError, Connection, answer_challenge, \
    deliver_challenge
from typing import Callable

log = logging.getLogger("megainfer.core_client")


class CoreSocket:
    """``address`` to give the child, ``authkey`` for its environment (never a command line)."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="megainfer-core-")  # mode 0700
        self.address = os.path.join(self.dir, "core.sock")
        self.authkey = secrets.token_bytes(32)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.address)
        self.listener.listen(1)

    def accept(self, check: Callable[[], None], poll_s: float) -> Connection:
        """The first authenticated connection (others are dropped with a warning); ``check``
        runs every ``poll_s`` while none came and raises to give up. The socket is closed and
        removed when this returns or raises."""
        try:
            while True:
                check()
                if not select.select([self.listener], [], [], poll_s)[0]:
                    continue
                sock, _ = self.listener.accept()
                conn = Connection(sock.detach())
                try:
                    deliver_challenge(conn, self.authkey)
                    answer_challenge(conn, self.authkey)
                    return conn
                except (AuthenticationError, OSError, EOFError) as e:
                    log.warning("refused a connection to %s: %s", self.address, e)
                    conn.close()
        finally:
            self.close()

    def close(self) -> None:
        self.listener.close()
        shutil.rmtree(self.dir, ignore_errors=True)
