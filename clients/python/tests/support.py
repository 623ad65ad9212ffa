"""Where the tests' stopgate is: the Go harness (go test ./clients/) starts it and says so in the environment."""

from __future__ import annotations

import os
import time
import uuid
from typing import Callable, TypeVar

import stopgate

T = TypeVar("T")


def env(name: str) -> str:
    v = os.environ.get(name)
    if not v:
        raise RuntimeError(f"${name} is not set: these tests run against a real stopgate serve; run them with `go test ./clients/`")
    return v


CONTROL = env("STOPGATE_TEST_CONTROL")
CONTROL_B = env("STOPGATE_TEST_CONTROL_B")
TOKEN = env("STOPGATE_TEST_TOKEN")
PROXY = env("STOPGATE_TEST_PROXY")
REDIS = env("STOPGATE_TEST_REDIS")
HTTP_UPSTREAM = env("STOPGATE_TEST_HTTP_UPSTREAM")
HTTPS_UPSTREAM = env("STOPGATE_TEST_HTTPS_UPSTREAM")


def operator(control: str = CONTROL) -> stopgate.Client:
    return stopgate.Client(control, TOKEN, actor="test:python")


def run_id(prefix: str = "py") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def eventually(what: str, cond: Callable[[], T], within: float = 10.0, every: float = 0.05) -> T:
    """Polls cond until it returns something true, for at most `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within}s: {what}")
        time.sleep(every)
