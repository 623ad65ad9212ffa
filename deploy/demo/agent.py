#!/usr/bin/env python3
"""A stand-in for an agent: it charges a card every second until it is told no.

It knows nothing of stopgate. Python's urllib sends through HTTP_PROXY /
http_proxy (HTTPS_PROXY for https) and trusts the CAs of SSL_CERT_FILE, which
`stopgate exec` sets; so once the run is cancelled, the next charge is refused
by stopgate before it leaves, and the agent stops. It stops too on the SIGTERM
stopgate exec sends at the cancel. Standard library only.

    python3 agent.py UPSTREAM_URL [MAX_REQUESTS]     (default 120)
"""
import json
import signal
import sys
import time
import urllib.error
import urllib.request


def stop(signum, frame):
    print("python agent: SIGTERM (the run was cancelled), stopping", flush=True)
    sys.exit(0)


def main():
    signal.signal(signal.SIGTERM, stop)
    upstream = sys.argv[1].rstrip("/")
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else 120
    for n in range(1, limit + 1):
        body = json.dumps({"agent": "python", "charge": n}).encode()
        req = urllib.request.Request(upstream + "/charge", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                print(f"python agent: charge {n}: {resp.status}", flush=True)
        except urllib.error.HTTPError as e:
            print(f"python agent: charge {n}: {e.code} {e.headers.get('X-Stopgate-Refusal', '')}: {e.read().decode()}", flush=True)
            print("python agent: refused, stopping", flush=True)
            return 0
        time.sleep(1)
    print(f"python agent: {limit} charges and never refused", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
