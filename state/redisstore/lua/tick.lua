-- tick: ARGV actor.
-- Expires leases and moves a cancelled run on. Safe from any number of
-- instances at once: each step sees the previous one's result, and a tick
-- with nothing to do writes nothing.
local actor = ARGV[1]
local run = load_run()
if not run then
  return reply('notfound', 'run')
end
if final(run) then
  return reply('ok', '', run)
end
local now = now_ms(run)
expire_leases(run, now, actor)
finalize(run, now, actor)
commit(run, now)
return reply('ok', '', run)
