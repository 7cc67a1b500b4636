"""Shared by the tests: the repo's flat modules importable, and free TCP ports for torchrun / MASTER_PORT."""

import os
import socket
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
sys.path[:0] = [ROOT, TESTS]


def free_port() -> int:
    """A TCP port that nothing listens on now (the OS picks it), for one torchrun rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
