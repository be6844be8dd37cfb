"""Mooncake's transfer engine (PyPI `mooncake-transfer-engine`, SGLang's default for PD
disaggregation): registered memory written directly into a peer's registered memory, over
TCP here and RDMA on clusters. Peers find each other with Mooncake's P2P handshake (no
metadata server): a peer's session id is "host:rpc_port".
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger("kdaserve")

# libibverbs and the libnl libraries it needs: the engine links them even for TCP, its wheel
# does not carry them, and scripts/fetch_rdma_libs.sh puts Debian's copies here when the
# system has none (preloaded by soname, so the engine's own lookup finds them loaded)
RDMA_LIBS = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")


def _rdma_dirs() -> list[Path]:
    dirs = [Path(sys.prefix) / "lib" / "rdma-core"]
    if os.environ.get("KDASERVE_RDMA_LIBS"):
        dirs.insert(0, Path(os.environ["KDASERVE_RDMA_LIBS"]))
    return dirs


def _load_engine_class() -> Any:
    # its glog lines ("Local segment descriptor not found" on every P2P start) are noise;
    # failures come back as return codes, which we raise on
    os.environ.setdefault("GLOG_minloglevel", "3")
    try:
        from mooncake.engine import TransferEngine
        return TransferEngine
    except ImportError as first:
        if "libibverbs" not in str(first) and "libnl" not in str(first):
            raise ImportError(f"{first}; prefill/decode disaggregation needs Mooncake's "
                              "transfer engine: pip install 'kdaserve[pd]'") from first
        for d in _rdma_dirs():
            if (d / RDMA_LIBS[-1]).exists():
                for lib in RDMA_LIBS:
                    ctypes.CDLL(str(d / lib), mode=ctypes.RTLD_GLOBAL)
                from mooncake.engine import TransferEngine
                return TransferEngine
        raise ImportError(f"{first}: Mooncake's transfer engine links libibverbs; install "
                          "rdma-core's libibverbs1 or run scripts/fetch_rdma_libs.sh "
                          f"{_rdma_dirs()[-1]}") from first


class MooncakeTransfer:
    """One transfer engine per process: `register` memory once, then `write` batches of
    (source address, destination address, length) into a peer's registered memory."""

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp") -> None:
        self.engine = _load_engine_class()()
        if host in ("0.0.0.0", ""):  # a peer needs an address it can reach, not a wildcard
            host = socket.gethostbyname(socket.gethostname())
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise RuntimeError(f"Mooncake transfer engine failed to initialize on {host} "
                               f"({protocol}): rc={rc}")
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"
        self.registered: list[tuple[int, int]] = []

    def register(self, address: int, length: int) -> None:
        rc = self.engine.register_memory(address, length)
        if rc != 0:
            raise RuntimeError(f"Mooncake could not register {length} bytes at {address:#x}: "
                               f"rc={rc}")
        self.registered.append((address, length))

    def unregister_all(self) -> None:
        for address, _ in self.registered:
            self.engine.unregister_memory(address)
        self.registered = []

    def write(self, peer: str, spans: list[tuple[int, int, int]]) -> None:
        """Writes every (src, dst, length) span into peer's memory; returns when all landed.
        Raises on failure (the peer died or refused)."""
        if not spans:
            return
        src, dst, lengths = (list(x) for x in zip(*spans, strict=True))
        rc = self.engine.batch_transfer_sync_write(peer, src, dst, lengths)
        if rc != 0:
            raise ConnectionError(f"Mooncake transfer to {peer} failed (rc={rc}, "
                                  f"{len(spans)} spans, {sum(lengths)} bytes)")
