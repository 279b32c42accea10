"""The per-rollout agent command when a fork server runs the agent (see `forkserver.py`).

Standard library only and run with `python -I -S`, so it starts in milliseconds: it sends its
environment, working directory and standard streams to the fork server at the socket path given
as its argument, then waits and exits with the agent's exit code. Killing it (SIGTERM on a
timeout or a cancelled rollout) closes the connection, and the server kills the agent.

    python -I -S launch.py SOCKET
"""

import json
import os
import signal
import socket
import struct
import sys


def main() -> int:
    """Hand this process's place over to a forked agent and return its exit code."""
    if len(sys.argv) != 2:
        print("usage: launch.py SOCKET", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(128 + signum))
    request = json.dumps({"env": dict(os.environ), "cwd": os.getcwd()}).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(sys.argv[1])
    except OSError as exc:
        print(f"no agent fork server at {sys.argv[1]}: {exc}", file=sys.stderr)
        return 1
    message = struct.pack("!I", len(request)) + request
    sent = socket.send_fds(conn, [message], [0, 1, 2])
    conn.sendall(message[sent:])
    answer = b""
    while len(answer) < 4:
        chunk = conn.recv(4 - len(answer))
        if not chunk:
            print("the agent fork server went away", file=sys.stderr)
            return 1
        answer += chunk
    (code,) = struct.unpack("!i", answer)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
