-- admit: ARGV actor, reason.
-- Creates the run ACTIVE at version 1; an ACTIVE run is returned as it is
-- (so a repeated admit is harmless); any other status is a conflict.
local actor, reason = ARGV[1], ARGV[2]
local run = load_run()
if run then
  if run.status ~= 'ACTIVE' then
    return reply('conflict', 'run_not_active', run)
  end
  return reply('ok', '', run)
end
local now = now_ms(nil)
run = {status = 'ACTIVE', v = '1', o = '0', created = int(now), updated = int(now)}
event(run, actor, 'run.admitted', reason, '', 'ACTIVE')
commit(run, now)
return reply('ok', '', run)
