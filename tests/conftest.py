"""Shared by the tests: the repo's flat modules importable, free TCP ports, and torchrun launches."""

import os
import socket
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
sys.path[:0] = [ROOT, TESTS]


def free_port() -> int:
    """A TCP port that nothing listens on now (the OS picks it), for one torchrun rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_torchrun(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run of a torchrun command, once more (on a fresh port) if a rank died of SIGSEGV.

    gloo on CPU segfaults rarely and at random inside a collective (seen twice in ~250 multi-process
    launches, in different tests, each passing when rerun); a second crash fails the test as any error does.
    """
    result = subprocess.run(cmd, **kwargs)
    if result.returncode != 0 and "Signal 11 (SIGSEGV)" in (result.stderr or ""):
        print(f"a rank died of SIGSEGV; running once more: {' '.join(map(str, cmd))[:300]}", file=sys.stderr)
        port = cmd.index("--master_port") + 1
        result = subprocess.run([*cmd[:port], str(free_port()), *cmd[port + 1:]], **kwargs)
    return result


def run_worker(script: str, out, *args, env: dict | None = None):
    """Run tests/<script> in a fresh single process (its argv: *args) and return what it saved to `out`."""
    import torch

    result = subprocess.run([sys.executable, os.path.join(TESTS, script), *map(str, args)], capture_output=True,
                            text=True, timeout=900, cwd=ROOT,
                            env={**os.environ, "MASTER_PORT": str(free_port()), **(env or {})})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-5000:]
    return torch.load(out)
