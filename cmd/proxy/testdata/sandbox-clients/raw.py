"""A raw socket: HTTP written by hand, no proxy settings read."""
import socket
import sys

host, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    s = socket.create_connection((host, port), timeout=20)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}".encode())
    head = s.recv(4096).decode(errors="replace").splitlines()
    print("raw", head[0].split(" ")[1] if head else "closed")
except OSError as e:
    print("raw error", e.__class__.__name__)
