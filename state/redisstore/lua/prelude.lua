-- prelude.lua is concatenated in front of every per-run script, so the rules
-- that several operations share (time, counts, audit, lease expiry,
-- finalize) are written once. See docs/state-machine.md for the rules.
--
-- KEYS, the same for every per-run script; all carry the hash tag {RUN}, so a
-- script touches one slot and runs unchanged on Redis Cluster:
--   1 run row (hash)                 2 intents (hash: key -> JSON)
--   3 creation order (list of keys)  4 derived-key counters (hash: base -> n)
--   5 leases (zset: expiry ms -> key of an IN_FLIGHT intent)
--   6 scheduled retries (zset: creation ordinal -> key of a SCHEDULED intent)
--   7 audit log (stream)
local K_RUN, K_INTENTS, K_ORDER, K_SEQ, K_INFLIGHT, K_SCHED, K_EVENTS =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]

-- changed turns true with the first audit event: every change of a run or an
-- intent is audited, so a step without events wrote nothing and need not
-- save the row (Tick runs often; a no-op must not cost an AOF fsync).
local changed = false

-- Numbers go to Redis as decimal integers; left to Redis, a Lua number may
-- be written in exponent form.
local function int(n)
  return string.format('%d', n)
end

-- The row as a table of strings, or nil for a run never seen.
local function load_run()
  local flat = redis.call('HGETALL', K_RUN)
  if #flat == 0 then
    return nil
  end
  local run = {}
  for i = 1, #flat, 2 do
    run[flat[i]] = flat[i + 1]
  end
  return run
end

-- The whole row is written back at the end of a step: one HSET, and the
-- row's fields and counts can never be saved half-way.
local function save_run(run)
  local args = {}
  for k, v in pairs(run) do
    args[#args + 1] = k
    args[#args + 1] = v
  end
  redis.call('HSET', K_RUN, unpack(args))
end

-- The server's clock in ms.
local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Server time in ms (read now, or once by the caller as at), never earlier
-- than the run's last step (field t), so the audit log of a run reads in
-- order even if the server clock steps back.
local function now_ms(run, at)
  local now = at or server_ms()
  if run and run.t then
    local last = tonumber(run.t)
    if last and last > now then
      now = last
    end
  end
  return now
end

-- Intent counts by state live in the row (fields n:STATE), moved in the same
-- step as the intent.
local function count(run, from, to)
  if from and from ~= '' then
    run['n:' .. from] = int((tonumber(run['n:' .. from]) or 0) - 1)
  end
  if to and to ~= '' then
    run['n:' .. to] = int((tonumber(run['n:' .. to]) or 0) + 1)
  end
end

local function n_of(run, st)
  return tonumber(run['n:' .. st]) or 0
end

-- Appends one line to the run's audit log. The stream id orders events in
-- commit order; 'at' is the step's time and 'v' the row's version after it.
local function event(run, now, actor, kind, f)
  local args = {K_EVENTS, '*', 'at', int(now), 'actor', actor, 'kind', kind, 'v', run.v}
  for _, name in ipairs({'reason', 'from', 'to', 'intent'}) do
    local x = f[name]
    if x and x ~= '' then
      args[#args + 1] = name
      args[#args + 1] = x
    end
  end
  redis.call('XADD', unpack(args))
  changed = true
end

local function load_intent(key)
  local raw = redis.call('HGET', K_INTENTS, key)
  if not raw then
    return nil
  end
  return cjson.decode(raw)
end

local function save_intent(it)
  redis.call('HSET', K_INTENTS, it.key, cjson.encode(it))
end

-- A new record takes the next place in the creation order; its ordinal
-- sorts the scheduled retries and the intents a deadline cuts.
local function new_intent(key, now)
  local ord = redis.call('RPUSH', K_ORDER, key)
  return {key = key, ord = ord, attempts = 0, refusals = 0, created_at = now, updated_at = now}
end

-- Moves an intent on by the step itself rather than by its carrier:
-- revoked by the cancel, expired, or cut by the drain deadline.
local function force(run, it, now, actor, to, why, kind)
  local from = it.state
  it.state = to
  it.reason = why
  it.updated_at = now
  save_intent(it)
  count(run, from, to)
  event(run, now, actor, kind, {from = from, to = to, reason = why, intent = it.key})
end

-- Every IN_FLIGHT intent whose lease expired becomes UNKNOWN: a carrier that
-- died is never taken as proof that nothing happened.
local function expire_leases(run, now, actor)
  local due = redis.call('ZRANGEBYSCORE', K_INFLIGHT, '-inf', int(now))
  for _, key in ipairs(due) do
    redis.call('ZREM', K_INFLIGHT, key)
    local it = load_intent(key)
    if it and it.state == 'IN_FLIGHT' then
      force(run, it, now, actor, 'UNKNOWN', 'lease_expired', 'intent.lease_expired')
    end
  end
end

local function move(run, now, actor, to, why)
  local from = run.status
  run.status = to
  run.status_reason = why
  run.updated = int(now)
  event(run, now, actor, 'run.transition', {from = from, to = to, reason = why})
end

-- Moves a CANCELLING or UNKNOWN run on, as far as its intents allow.
local function finalize(run, now, actor)
  local inflight, unknown = n_of(run, 'IN_FLIGHT'), n_of(run, 'UNKNOWN')
  if run.status == 'CANCELLING' then
    if inflight == 0 and unknown == 0 then
      move(run, now, actor, 'CANCELLED', 'drained')
    elseif inflight == 0 then
      -- Past the deadline, what is unknown was cut by it (by this tick or
      -- by the carrier that saw the deadline first).
      if now >= (tonumber(run.drain) or 0) then
        move(run, now, actor, 'UNKNOWN', 'drain_timeout')
      else
        move(run, now, actor, 'UNKNOWN', 'unresolved_intents')
      end
    elseif now >= (tonumber(run.drain) or 0) then
      local cut = {}
      for _, key in ipairs(redis.call('ZRANGE', K_INFLIGHT, 0, -1)) do
        local it = load_intent(key)
        if it and it.state == 'IN_FLIGHT' then
          cut[#cut + 1] = it
        end
      end
      -- Creation order reads best in the audit log.
      table.sort(cut, function(a, b) return a.ord < b.ord end)
      for _, it in ipairs(cut) do
        force(run, it, now, actor, 'UNKNOWN', 'drain_timeout', 'intent.outcome')
      end
      redis.call('DEL', K_INFLIGHT)
      move(run, now, actor, 'UNKNOWN', 'drain_timeout')
    end
  elseif run.status == 'UNKNOWN' and inflight == 0 and unknown == 0 then
    move(run, now, actor, 'CANCELLED', 'reconciled')
  end
end

-- Ends a step that changed something: the row keeps the step's time (see
-- now_ms) and is written back whole.
local function commit(run, now)
  if changed then
    run.t = int(now)
    save_run(run)
  end
end

local function final(run)
  return run.status == 'CANCELLED' or run.status == 'COMPLETED'
end
