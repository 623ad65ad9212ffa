// Package clients holds stopgate's clients for workers, which are not Go:
// clients/python (the stopgate package, with its Celery integration) and
// clients/node (@stopgate/client, with its BullMQ integration).
//
// Its Go tests are their harness: they build stopgate, serve it on free
// loopback ports over a real redis-server (two instances sharing the store,
// as a fleet does), and run each client's own tests against it — Debian's
// python3 -m unittest and node --test — with real Celery workers and a real
// BullMQ queue on the same Redis. They also measure how soon a watch stream
// hears a cancel on the instance that took it and on another.
package clients
