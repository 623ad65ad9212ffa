-- complete: ARGV actor, reason, observed version.
-- ACTIVE -> COMPLETED, only at the version the caller observed.
local actor, reason, version = ARGV[1], ARGV[2], tonumber(ARGV[3])
local run = load_run()
if not run then
  return reply('notfound', 'run')
end
if run.status ~= 'ACTIVE' then
  return reply('conflict', 'run_not_active', run)
end
if tonumber(run.v) ~= version then
  return reply('conflict', 'stale_version', run, nil, 'completion observed cancel_version ' .. ARGV[3])
end
local now = now_ms(run)
run.status = 'COMPLETED'
run.reason = reason
run.updated = int(now)
event(run, actor, 'run.completed', reason, 'ACTIVE', 'COMPLETED')
commit(run, now)
return reply('ok', '', run)
