-- resolve: ARGV actor, key, applied (1/0), source, note.
-- Reconciles an UNKNOWN intent, then moves a cancelled run on.
local actor, key, applied, source, note = ARGV[1], ARGV[2], ARGV[3] == '1', ARGV[4], ARGV[5]
local run = load_run()
if not run then
  return cjson.encode({notfound = 'run'})
end
local it = load_intent(key)
if not it then
  return cjson.encode({notfound = 'intent'})
end
if it.state ~= 'UNKNOWN' then
  return cjson.encode({run = run, intent = it, conflict = 'intent_not_unknown'})
end
local now = now_ms(run)
local to = 'NOT_APPLIED'
if applied then
  to = 'APPLIED'
end
it.state = to
it.source = source
if note ~= '' then
  it.note = note
else
  it.note = nil
end
it.updated_at = now
save_intent(it)
count(run, 'UNKNOWN', to)
local why = source
if note ~= '' then
  why = source .. ': ' .. note
end
event(run, now, actor, 'intent.resolved', {from = 'UNKNOWN', to = to, reason = why, intent = key})
finalize(run, now, actor)
commit(run, now)
return cjson.encode({run = run, intent = it})
