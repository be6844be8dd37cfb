"""uvicorn's h11 protocol with a request-header timeout: uvicorn times out idle keep-alive
connections but waits forever for a client that trickles its request headers (slowloris),
holding a connection and its buffers; this closes such a connection after `timeout` seconds
(the ASGI app only ever sees complete headers, so this cannot live in a middleware)."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


def with_header_timeout(timeout: float) -> type[H11Protocol]:
    class H11WithHeaderTimeout(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(timeout, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def connection_made(self, transport: Any) -> None:  # a client that sends nothing
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._between_requests():
                self._arm()  # the first bytes of a request: its headers must follow in time
            super().data_received(data)
            if not self._between_requests():
                self._disarm()  # headers complete: the request runs (bodies: BodyGuard)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # a pipelined request already buffered is parsed from here, not data_received
            if self._between_requests() and self.conn.trailing_data[0]:
                self._arm()

        def timeout_keep_alive_handler(self) -> None:
            self._disarm()
            super().timeout_keep_alive_handler()

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self._between_requests() and not self.transport.is_closing():
                self.transport.close()

    return H11WithHeaderTimeout
