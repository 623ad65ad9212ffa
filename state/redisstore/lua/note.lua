-- note: ARGV actor, key, kind, reason.
-- Appends one event about an existing intent; nothing else changes.
local actor, key, kind, reason = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local run = load_fields({'status', 'o', 'v', 't'})
if not run then
  return reply('notfound', 'run')
end
if call('HEXISTS', K_RUN, 's:' .. key) == 0 then
  return reply('notfound', 'intent')
end
local now = now_ms(run)
event(run, actor, kind, reason, '', '', key)
commit(run, now)
return reply('ok')
