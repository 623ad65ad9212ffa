-- prune: ARGV final before ms.
-- Retention for one run: when the run is final and became final before
-- the limit, its intents, counters, leases, retries and audit log leave
-- the store; the row stays (so the run can never be admitted again), with
-- its counts and the time of the prune. Returns 1 when it pruned.
local before = tonumber(ARGV[1])
local st = redis.call('HMGET', K_RUN, 'status', 'updated')
if not (st[1] == 'CANCELLED' or st[1] == 'COMPLETED') then
  return 0
end
if not st[2] or tonumber(st[2]) >= before then
  return 0
end
redis.call('DEL', K_INTENTS, K_ORDER, K_SEQ, K_INFLIGHT, K_SCHED, K_EVENTS)
redis.call('HSET', K_RUN, 'pruned', int(server_ms()))
return 1
