-- note: ARGV actor, key, kind, reason.
-- Appends one event about an existing intent; nothing else changes.
local actor, key, kind, reason = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local run = load_run()
if not run then
  return cjson.encode({notfound = 'run'})
end
if redis.call('HEXISTS', K_INTENTS, key) == 0 then
  return cjson.encode({notfound = 'intent'})
end
local now = now_ms(run)
event(run, now, actor, kind, {reason = reason, intent = key})
commit(run, now)
return cjson.encode({run = run})
