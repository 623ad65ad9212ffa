-- admit: ARGV actor, reason.
-- Creates the run ACTIVE at version 1; an ACTIVE run is returned as it is
-- (so a repeated admit is harmless); any other status is a conflict.
local actor, reason = ARGV[1], ARGV[2]
local run = load_run()
if run then
  if run.status ~= 'ACTIVE' then
    return cjson.encode({run = run, conflict = 'run_not_active'})
  end
  return cjson.encode({run = run})
end
local now = now_ms(nil)
run = {status = 'ACTIVE', v = '1', created = int(now), updated = int(now)}
event(run, now, actor, 'run.admitted', {to = 'ACTIVE', reason = reason})
commit(run, now)
return cjson.encode({run = run, changed = true})
