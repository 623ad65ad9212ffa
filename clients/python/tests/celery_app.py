"""The Celery app the tests' workers run: tasks of GuardedTask on the tests' Redis.

Each task records, in Redis, when its body starts (the queue side's record) and
carries one effect through the guard (a record in a "provider" list), the way an
agent's tool call would.
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery

import stopgate.celery as sgc

REDIS = os.environ["STOPGATE_TEST_REDIS"]
BROKER, BACKEND, RECORDS = REDIS + "/1", REDIS + "/2", REDIS + "/3"

app = Celery("stopgate-test", broker=BROKER, backend=BACKEND, task_cls=sgc.GuardedTask)
app.conf.update(
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
)
records = redis.Redis.from_url(RECORDS)


@app.task(bind=True, max_retries=3)
def work(self: sgc.GuardedTask, i: int, steps: int) -> int:
    """Even tasks carry an effect, then fail and retry in 3 s; odd ones work `steps` tenths of a second, checking in between, then carry their effect."""
    step = sgc.current()
    assert step is not None
    records.rpush("starts", json.dumps({"task": self.request.id, "i": i, "attempt": self.request.retries, "at": time.time(), "worker": self.request.hostname}))
    if i % 2 == 0 and self.request.retries == 0:
        effect(step, "before-retry")
        raise self.retry(countdown=3)
    for _ in range(steps):
        sgc.checkpoint()
        time.sleep(0.1)
    effect(step, "done")
    return i


def effect(step: sgc.Step, what: str) -> None:
    key = f"effect:{step.step_id}:{what}"
    with step.client.effect(step.run_id, key, target="redis://provider", method="RPUSH"):
        records.rpush("effects", json.dumps({"key": key, "at": time.time()}))
