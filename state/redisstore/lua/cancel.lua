-- cancel: ARGV actor, reason, drain ms, pub/sub channel, run id, sync (1/0).
-- The compare-and-set ACTIVE -> CANCELLING. It revokes every scheduled retry
-- in the same step and publishes the run id only when it changed the row, so
-- repeating it (a caller retrying after a lost reply) changes nothing and
-- announces nothing twice.
local actor, reason, drain, channel, run_id = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
-- With sync, the caller WAITs for replicas after the script. WAIT counts
-- the replicas that have this connection's last write, so a cancel that
-- changes nothing (a retry after a WAIT fell short) still writes: the row's
-- step time, unchanged, which replicates after the cancel it confirms.
local sync = ARGV[6] == '1'
local run = load_run()
local now = now_ms(run)
if not run then
  -- A tombstone: the run can never be admitted later.
  run = {status = 'CANCELLED', v = '2', o = '0', reason = reason,
    created = int(now), updated = int(now), cancelled = int(now)}
  event(run, actor, 'run.cancel', reason, '', 'CANCELLED')
  commit(run, now)
  call('PUBLISH', channel, run_id)
  return reply('ok', '', run)
end
if run.status == 'COMPLETED' then
  return reply('conflict', 'run_not_active', run)
end
if run.status ~= 'ACTIVE' then
  if sync then
    call('HSET', K_RUN, 't', run.t or int(now))
  end
  return reply('ok', '', run)
end
run.status = 'CANCELLING'
run.v = int(tonumber(run.v) + 1)
run.reason = reason
run.cancelled = int(now)
run.updated = int(now)
run.drain = int(now + drain)
event(run, actor, 'run.cancel', reason, 'ACTIVE', 'CANCELLING')
for _, key in ipairs(call('ZRANGE', K_SCHED, 0, -1)) do
  local it = load_intent(key)
  if it and it.state == 'SCHEDULED' then
    force(run, it, now, actor, 'REVOKED', 'run_cancelled', 'intent.revoked')
  end
end
call('DEL', K_SCHED)
commit(run, now)
call('PUBLISH', channel, run_id)
return reply('ok', '', run)
