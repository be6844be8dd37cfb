"""uvicorn's h11 protocol with a request-header timeout: uvicorn times out idle keep-alive
connections but waits forever for a client that trickles its request headers (slowloris),
holding a connection and its buffers; this closes such a connection after `timeout` seconds
(the ASGI app only ever sees complete headers, so this cannot live in a middleware).

It also answers HTTP/2 "prior knowledge" as HTTP/2 says a server that wants HTTP/1.1 should
(GOAWAY with HTTP_1_1_REQUIRED). sglang-router probes every worker it registers with gRPC health
checks (h2c) beside its HTTP one, to learn which it speaks; h11 reads the preface's
`PRI * HTTP/2.0` as a request, then logs "Invalid HTTP request received" on the frames."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("kdaserve")

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# the server's preface (an empty SETTINGS frame), then GOAWAY: last stream 0, error 0xd
H2_REFUSAL = bytes.fromhex("000000" "04" "00" "00000000"
                           "000008" "07" "00" "00000000" "00000000" "0000000d")


def with_header_timeout(timeout: float) -> type[H11Protocol]:
    class H11WithHeaderTimeout(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _head: bytes | None = b""  # a connection's first bytes, until they are not HTTP/2's

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
            if self._head is not None:
                data = self._head + data
                if data[:len(H2_PREFACE)] == H2_PREFACE[:len(data)]:
                    if len(data) < len(H2_PREFACE):
                        self._head = data  # (too slow: the header timer closes it)
                    else:
                        self._refuse_http2()
                    return
                self._head = None  # HTTP/1 from here on
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

        def _refuse_http2(self) -> None:
            logger.debug("refused HTTP/2 (prior knowledge) from %s", self.client)
            self._head = None
            self.transport.write(H2_REFUSAL)
            self.transport.close()

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self._between_requests() and not self.transport.is_closing():
                self.transport.close()

    return H11WithHeaderTimeout
