"""Small network helpers without heavy imports (the launcher itself never imports torch)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port that is free on this host right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
