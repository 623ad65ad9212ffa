-- guard: ARGV actor, observed version, key, explicit (1/0), boundary,
-- method, target, body digest, auto-admit (1/0), allow cancelling (1/0),
-- not_before ms ('' to dispatch now), lease owner, lease ttl ms,
-- not_after ms ('' for no fence), refuse (a reason the edge already refused
-- the effect for, '' for none).
-- The one atomic check-and-record of an effect: the row's status and
-- version are read and the intent written in the same step, so no cancel
-- can commit in between.
local actor, observed_s, base, explicit = ARGV[1], ARGV[2], ARGV[3], ARGV[4] == '1'
local boundary, method, target, digest = ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local auto, allow_cancelling, not_before = ARGV[9] == '1', ARGV[10] == '1', ARGV[11]
local owner, ttl, not_after, refuse = ARGV[12], tonumber(ARGV[13]), tonumber(ARGV[14]), ARGV[15]

-- The fence comes before anything is read or written: a guard that Redis
-- runs after its caller gave up (queued behind a paused server, say) must
-- leave no trace. The server's clock decides, not the caller's. It is read
-- once: the step's time is the time the fence was checked at, even if the
-- server is stopped halfway through the script.
local clock = server_ms()
if not_after and clock > not_after then
  return cjson.encode({late = true})
end
local observed = tonumber(observed_s)

local run = load_run()
local now = now_ms(run, clock)
if not run then
  if not auto then
    -- Nothing is written for a run nobody admitted.
    return cjson.encode({refusal = 'run_not_admitted'})
  end
  run = {status = 'ACTIVE', v = '1', created = int(now), updated = int(now)}
  event(run, now, actor, 'run.admitted', {to = 'ACTIVE', reason = 'auto-admit'})
end

-- A derived key is a base: each dispatch gets its own record, base for the
-- first and base.n after. A name already taken (an explicit key that looks
-- derived) is skipped rather than overwritten.
local key = base
if not explicit then
  repeat
    local n = redis.call('HINCRBY', K_SEQ, base, 1)
    if n == 1 then
      key = base
    else
      key = base .. '.' .. n
    end
  until redis.call('HEXISTS', K_INTENTS, key) == 0
end

local version = tonumber(run.v)
local refusal
if refuse ~= '' then
  refusal = refuse
elseif run.status == 'ACTIVE' then
  if observed ~= 0 and observed ~= version then
    refusal = 'stale_version'
  end
elseif not (run.status == 'CANCELLING' and allow_cancelling and not_before == '') then
  refusal = 'run_not_active'
end

local existing
if explicit then
  existing = load_intent(key)
end

if refusal then
  if existing then
    -- What happened under this key stays recorded; only the refusal counts.
    existing.refusals = (existing.refusals or 0) + 1
    save_intent(existing)
    event(run, now, actor, 'intent.refused',
      {to = 'CANCELLED_BEFORE_DISPATCH', reason = refusal, intent = key})
    commit(run, now)
    return cjson.encode({run = run, intent = existing, refusal = refusal})
  end
  local it = new_intent(key, now)
  it.state = 'CANCELLED_BEFORE_DISPATCH'
  it.boundary, it.method, it.target, it.body_digest = boundary, method, target, digest
  it.observed_version = observed_s
  it.reason = refusal
  if not_before ~= '' then
    it.not_before = not_before
  end
  save_intent(it)
  count(run, nil, it.state)
  event(run, now, actor, 'intent.refused',
    {to = 'CANCELLED_BEFORE_DISPATCH', reason = refusal, intent = key})
  commit(run, now)
  return cjson.encode({run = run, intent = it, refusal = refusal})
end

if existing then
  local st = existing.state
  local dup
  -- A SCHEDULED retry guarded again without a time is its dispatch.
  if st == 'IN_FLIGHT' or st == 'UNKNOWN' or (st == 'SCHEDULED' and not_before ~= '') then
    dup = 'intent_in_progress'
  elseif digest ~= '' and (existing.body_digest or '') ~= '' and digest ~= existing.body_digest then
    dup = 'idempotency_key_reused'
  end
  if dup then
    -- The record stands as it is; the audit log keeps the attempt.
    event(run, now, actor, 'intent.refused', {reason = dup, intent = key})
    commit(run, now)
    return cjson.encode({run = run, intent = existing, refusal = dup})
  end
end

local from
local it = existing
if it then
  from = it.state
else
  it = new_intent(key, now)
end
it.boundary, it.method, it.target = boundary, method, target
if digest ~= '' then
  it.body_digest = digest
end
it.observed_version = observed_s
it.attempts = (it.attempts or 0) + 1
it.status_code = nil
it.reason, it.source, it.note = nil, nil, nil
it.updated_at = now
if not_before ~= '' then
  it.state = 'SCHEDULED'
  it.not_before = not_before
  it.lease_owner, it.lease_expires = nil, nil
  redis.call('ZADD', K_SCHED, int(it.ord), key)
else
  it.state = 'IN_FLIGHT'
  it.not_before = nil
  it.lease_owner = owner
  it.lease_expires = now + ttl
  redis.call('ZREM', K_SCHED, key)
  redis.call('ZADD', K_INFLIGHT, int(it.lease_expires), key)
end
save_intent(it)
count(run, from, it.state)
event(run, now, actor, 'intent.admitted', {from = from, to = it.state, intent = key})
commit(run, now)
return cjson.encode({run = run, intent = it, admitted = true})
