"""The wire between a notebook kernel and its live ranks (``%ranks``): framed messages on a loopback socket.

The kernel listens on 127.0.0.1 and each rank connects to it (helpers/launcher/live.py, helpers/launcher/live_rank.py).
A message is a JSON header and an optional blob of bytes (a pickled value), each preceded by its length::

    [4 bytes: header length][8 bytes: blob length][header, UTF-8 JSON][blob]

Standard library only: every live rank imports it, and so does the kernel (which need not import torch).
"""
from __future__ import annotations

import json
import socket
import struct
from typing import Any

PREFIX = struct.Struct("!IQ")
ADDRESS, TOKEN = "HELPERS_LIVE_ADDRESS", "HELPERS_LIVE_TOKEN"  # environment variables: where a rank connects, and how
MAX_HEADER = 16 << 20  # a header longer than this means the stream is not ours (or out of step): stop reading it


class Closed(ConnectionError):
    """The other end closed the connection (for a rank: the kernel is gone; for the kernel: the rank is gone)."""


def frame(header: dict[str, Any], blob: bytes = b"") -> bytes:
    """One message as bytes on the wire."""
    data = json.dumps(header).encode()
    return PREFIX.pack(len(data), len(blob)) + data + blob


def send(sock: socket.socket, header: dict[str, Any], blob: bytes = b"") -> None:
    sock.sendall(frame(header, blob))


class Reader:
    """Turns the bytes a socket delivers, in pieces of any size, into whole messages."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[dict[str, Any], bytes]]:
        """Add received bytes; return every message now complete, in order (a partial one waits for more)."""
        self.buffer += data
        messages = []
        while len(self.buffer) >= PREFIX.size:
            header_size, blob_size = PREFIX.unpack_from(self.buffer)
            if header_size > MAX_HEADER:
                raise ValueError(f"a message header of {header_size} bytes: this is not a live-rank stream")
            end = PREFIX.size + header_size + blob_size
            if len(self.buffer) < end:
                break
            header = json.loads(bytes(self.buffer[PREFIX.size:PREFIX.size + header_size]))
            messages.append((header, bytes(self.buffer[PREFIX.size + header_size:end])))
            del self.buffer[:end]
        return messages


def receive(sock: socket.socket, reader: Reader, pending: list) -> tuple[dict[str, Any], bytes]:
    """The next message (blocking): from `pending` if a read already delivered it, else read until one is whole."""
    while not pending:
        data = sock.recv(1 << 20)
        if not data:
            raise Closed("the other end closed the connection")
        pending.extend(reader.feed(data))
    return pending.pop(0)
