-- resolve: ARGV actor, key, applied (1/0), source, note.
-- Reconciles an UNKNOWN intent, then moves a cancelled run on.
local actor, key, applied, source, note = ARGV[1], ARGV[2], ARGV[3] == '1', ARGV[4], ARGV[5]
local run = load_run()
if not run then
  return reply('notfound', 'run')
end
local it = load_intent(key)
if not it then
  return reply('notfound', 'intent')
end
if it.state ~= 'UNKNOWN' then
  return reply('conflict', 'intent_not_unknown', run, {key, imm_of(it), mut_of(it)})
end
local now = now_ms(run)
local to = 'NOT_APPLIED'
if applied then
  to = 'APPLIED'
end
it.state = to
it.source = source
it.note = note
it.updated_at = now
local rec = save_intent(run, it)
count(run, 'UNKNOWN', to)
event(run, actor, 'intent.resolved', why_of(source, note), 'UNKNOWN', to, key)
finalize(run, now, actor)
commit(run, now)
return reply('ok', '', run, rec)
