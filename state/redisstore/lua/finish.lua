-- finish: ARGV actor, key, attempt, outcome, status code, reason, source.
-- Records what happened to an IN_FLIGHT intent (or a late answer for one a
-- deadline turned UNKNOWN), then moves a cancelled run on. A repeat of a
-- finish that already landed is refused, never applied twice.
local actor, key, attempt, outcome = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local code, reason, source = tonumber(ARGV[5]), ARGV[6], ARGV[7]
local run = load_run()
if not run then
  return cjson.encode({notfound = 'run'})
end
local it = load_intent(key)
if not it then
  return cjson.encode({notfound = 'intent'})
end
local from = it.state
local late = from == 'UNKNOWN' and outcome == 'RESPONDED'
if from ~= 'IN_FLIGHT' and not late then
  return cjson.encode({run = run, intent = it, conflict = 'intent_not_in_flight',
    detail = 'outcome ' .. outcome})
end
if attempt ~= it.attempts then
  return cjson.encode({run = run, intent = it, conflict = 'stale_attempt',
    detail = 'report for attempt ' .. ARGV[3] .. ', latest is ' .. int(it.attempts)})
end
local now = now_ms(run)
it.state = outcome
if code > 0 then
  it.status_code = code
else
  it.status_code = nil
end
if late then
  it.reason = 'late_response'
elseif reason ~= '' then
  it.reason = reason
else
  it.reason = nil
end
if source ~= '' then
  it.source = source
else
  it.source = nil
end
it.lease_owner, it.lease_expires = nil, nil
it.updated_at = now
redis.call('ZREM', K_INFLIGHT, key)
save_intent(it)
count(run, from, outcome)
-- The audit reason leads with the source, as a resolution's does.
local why = it.reason
if source ~= '' then
  why = source
  if it.reason then
    why = source .. ': ' .. it.reason
  end
end
event(run, now, actor, 'intent.outcome', {from = from, to = outcome, reason = why, intent = key})
finalize(run, now, actor)
commit(run, now)
return cjson.encode({run = run, intent = it})
