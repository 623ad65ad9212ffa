-- complete: ARGV actor, reason, observed version.
-- ACTIVE -> COMPLETED, only at the version the caller observed.
local actor, reason, version = ARGV[1], ARGV[2], tonumber(ARGV[3])
local run = load_run()
if not run then
  return cjson.encode({notfound = 'run'})
end
if run.status ~= 'ACTIVE' then
  return cjson.encode({run = run, conflict = 'run_not_active'})
end
if tonumber(run.v) ~= version then
  return cjson.encode({run = run, conflict = 'stale_version',
    detail = 'completion observed cancel_version ' .. ARGV[3]})
end
local now = now_ms(run)
run.status = 'COMPLETED'
run.reason = reason
run.updated = int(now)
event(run, now, actor, 'run.completed', {from = 'ACTIVE', to = 'COMPLETED', reason = reason})
commit(run, now)
return cjson.encode({run = run, changed = true})
