"""uvicorn's httptools protocol with a bound on how long a client may take to send a request's
headers (``serve.header_timeout_s``): from the connection's start, and from the first byte of
each later request on it, to the end of its headers; past it the connection is closed. uvicorn
bounds only the idle time between requests (``timeout_keep_alive``), so without this a client
that stops halfway through its headers holds its connection for ever. The body's pace is the
gate's (``gate.RequestGate``)."""
from __future__ import annotations

from typing import Optional

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def header_timeout_protocol(timeout_s: float) -> type:
    """The protocol class to give ``uvicorn.Config(http=...)``."""

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:
            self.header_timer = None
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self.header_timer is None:
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self.header_timer = self.loop.call_later(timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _too_slow(self) -> None:
            self.header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol
