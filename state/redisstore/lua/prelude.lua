-- prelude.lua comes first in the library of stopgate's Redis functions (or,
-- where Redis has no functions, in front of every script), so the rules
-- several operations share (time, counts, audit, the intent record, lease
-- expiry, finalize, the reply) are written once. See
-- docs/state-machine.md for the rules and docs/redis.md for the layout.
--
-- KEYS, the same for every per-run operation; all carry the hash tag {RUN},
-- so an operation touches one slot and runs unchanged on Redis Cluster:
--   1 run (hash): the row's fields, and every intent of the run in two
--     fields, i:KEY (what the guard recorded once) and s:KEY (what moves)
--   2 intents of a run written before layout 2 (hash: key -> JSON)
--   3 creation order of those (list of keys)
--   4 derived-key counters (hash: base -> n, only for bases used twice)
--   5 leases (zset: -expiry ms -> key of an IN_FLIGHT intent; negative, so
--     that a new lease, the latest to expire, goes to the head of a small
--     sorted set, which Redis keeps as a list it scans from the head; and,
--     while many are in flight, LEASE_MARK), but for the lone lease (the
--     row's field l, see LONE)
--   6 scheduled retries (zset: creation ordinal -> key of a SCHEDULED intent)
--   7 audit log (stream)
--
-- As a function library this code runs once, when the library loads, and
-- its locals outlive each call: begin resets every one of them at the start
-- of a call, so no call sees another's state.
local K_RUN, K_LEGACY, K_ORDER, K_SEQ, K_INFLIGHT, K_SCHED, K_EVENTS
local A -- the call's arguments
local call

-- changed turns true with the first audit event: every change of a run or an
-- intent is audited, so a step without events wrote nothing and need not
-- save the row (Tick runs often; a no-op must not cost an AOF write).
local changed = false

-- Redis keeps a small sorted set as a listpack, and every ZADD and ZREM
-- scans it end to end, about a hundred instructions an entry: with dozens of
-- a run's intents in flight, the leases cost more than the rest of a step.
-- A set with a member longer than Redis keeps in a listpack (64 bytes) is a
-- skiplist instead, where a member is found by its hash. So a step that
-- leaves LEASE_MARK_AT or more intents in flight adds LEASE_MARK to the set
-- (the batch's common path does), scored -inf so that it never comes due;
-- it has spaces in it, so it never names an intent. A step that leaves none
-- in flight removes it, and the set with it: an idle run keeps no set.
local LEASE_MARK = 'lease set marker: while many leases are in flight this member keeps the set a skiplist'
local LEASE_MARK_AT = 16

-- LONE: a run with one effect in flight at a time (one connection, one
-- agent of a fleet) would add its lease to the set and remove it again at
-- every request, two commands of a step's five. So the batch's common
-- path gives a guard that finds nothing in flight the lone lease instead:
-- the row's field l names its key, and its expiry stays where every
-- lease's is, in its record (s:KEY). Every IN_FLIGHT intent's lease is in
-- the set or is the lone one; whatever reads leases (expire_leases, the
-- drain's cut in finalize, renew, an outcome) reads l too, so every step
-- that may call them reads the row's l. While the set holds LEASE_MARK
-- there is no lone lease: the batch moves it into the set with the marker,
-- so that the last intent to leave, whichever it is, takes the marker with
-- it.

-- The row is a table of strings, intents' fields included once a step
-- writes them. loaded keeps the values read, so that a step writes back
-- only the fields it changed, all in one HSET: the row and the intents of
-- a step are saved together.
local loaded

-- clock is the server time of the call, read once (TIME) for all the steps
-- of a batch: they run in one atomic step of the server, at one instant;
-- clock_text is it in the decimal text the records carry.
local clock, clock_text

-- step_ms is the time of the step being written (its clock read, never
-- earlier than the run's last step): the time its audit events carry.
local step_ms

-- Numbers go to Redis as decimal integers; left to Redis, a Lua number may
-- be written in exponent form.
local function int(n)
  return string.format('%d', n)
end

-- use_run points the per-run keys at the run whose seven keys follow
-- keys[k], and starts its steps afresh (a batch runs the steps of several
-- runs in one call, one run after the other).
local function use_run(keys, k)
  K_RUN, K_LEGACY, K_ORDER, K_SEQ, K_INFLIGHT, K_SCHED, K_EVENTS =
    keys[k + 1], keys[k + 2], keys[k + 3], keys[k + 4], keys[k + 5], keys[k + 6], keys[k + 7]
  changed, loaded, step_ms = false, nil, nil
end

local function begin(keys, args)
  use_run(keys, 0)
  A = args
  call = redis.call
  clock = nil
end

-- error_text is the message of an error pcall caught: a failed redis.call
-- raises a table holding it in err.
local function error_text(e)
  if type(e) == 'table' and e.err then
    return e.err
  end
  return tostring(e)
end

-- ms_text is the time TIME answers (seconds and microseconds, as text) in
-- ms, as text: the seconds, then the first three of the microseconds' six
-- digits. Put together from TIME's texts, the clock costs one strtod:
-- reading a number from text and writing one as text cost glibc's strtod
-- and sprintf, about a thousand instructions each, and the arithmetic took
-- two of one and one of the other.
local function ms_text(sec, usec)
  return sec .. string.sub('00000' .. usec, -6, -4)
end

-- The server's clock in ms, read once per call.
local function server_ms()
  if not clock then
    local t = call('TIME')
    clock_text = ms_text(t[1], t[2])
    clock = tonumber(clock_text)
  end
  return clock
end

-- The row's own fields (the intents' are read by name where needed).
local ROW = {'status', 'v', 'reason', 'status_reason', 'created', 'updated', 'cancelled', 'drain', 't',
  'o', 'pruned', 'n:IN_FLIGHT', 'n:SCHEDULED', 'n:RESPONDED', 'n:NOT_SENT', 'n:UNKNOWN',
  'n:CANCELLED_BEFORE_DISPATCH', 'n:REVOKED', 'n:APPLIED', 'n:NOT_APPLIED', 'l'}

-- An intent in a step: a table of named fields and its key.
--
-- Stored in two fields of the run's hash, each made by concatenation and
-- read back with one string.match, so that a step never encodes or decodes
-- more than it touches:
--   i:KEY  "boundary created ord observed" then, a line each: method,
--          target, digest
--   s:KEY  "state attempts refusals code lease updated not_before" then, a
--          line each: owner, reason, source, note
-- A text with a newline or a backslash in it is escaped (\n, \\); an empty
-- not_before is "-". An outcome rewrites s:KEY alone.
local ESC = {['\\'] = '\\\\', ['\n'] = '\\n'}
local UNESC = {['\\\\'] = '\\', ['\\n'] = '\n'}

-- The audit reason of an outcome or a resolution: its source first when it
-- has one ("safe_method: run_cancelled").
local function why_of(source, reason)
  if source == '' then
    return reason
  end
  if reason == '' then
    return source
  end
  return source .. ': ' .. reason
end

local function esc(s)
  if string.find(s, '\n', 1, true) or string.find(s, '\\', 1, true) then
    return (string.gsub(s, '[\n\\]', ESC))
  end
  return s
end

local function unesc(s)
  if string.find(s, '\\', 1, true) then
    return (string.gsub(s, '\\[\\n]', UNESC))
  end
  return s
end

local function imm_of(it)
  return it.boundary .. ' ' .. int(it.created_at) .. ' ' .. int(it.ord) .. ' ' .. it.observed_version ..
    '\n' .. esc(it.method) .. '\n' .. esc(it.target) .. '\n' .. esc(it.body_digest)
end

local function mut_of(it)
  local nb = it.not_before
  if nb == '' then
    nb = '-'
  end
  return it.state .. ' ' .. int(it.attempts) .. ' ' .. int(it.refusals) .. ' ' .. int(it.status_code) .. ' ' ..
    int(it.lease_expires) .. ' ' .. int(it.updated_at) .. ' ' .. nb .. '\n' .. esc(it.lease_owner) .. '\n' ..
    esc(it.reason) .. '\n' .. esc(it.source) .. '\n' .. esc(it.note)
end

local function decode_intent(key, imm, mut)
  local it = {key = key}
  local b, c, o, ov, m, t, d = string.match(imm, '^(%S+) (%d+) (%d+) (%S+)\n([^\n]*)\n([^\n]*)\n([^\n]*)$')
  it.boundary, it.created_at, it.ord, it.observed_version = b, tonumber(c), tonumber(o), ov
  it.method, it.target, it.body_digest = unesc(m), unesc(t), unesc(d)
  local st, at, rf, code, lease, upd, nb, ow, re, so, no =
    string.match(mut, '^(%S+) (%d+) (%d+) (%d+) (%d+) (%d+) (%S+)\n([^\n]*)\n([^\n]*)\n([^\n]*)\n([^\n]*)$')
  it.state, it.attempts, it.refusals, it.status_code = st, tonumber(at), tonumber(rf), tonumber(code)
  it.lease_expires, it.updated_at = tonumber(lease), tonumber(upd)
  if nb == '-' then
    nb = ''
  end
  it.not_before = nb
  it.lease_owner, it.reason, it.source, it.note = unesc(ow), unesc(re), unesc(so), unesc(no)
  return it
end

-- A record of a run written before layout 2 (JSON), as an intent.
local function decode_legacy(key, raw)
  local j = cjson.decode(raw)
  local function s(v)
    if v == nil or v == cjson.null then
      return ''
    end
    return tostring(v)
  end
  local function n(v)
    return tonumber(v) or 0
  end
  return {key = key, boundary = s(j.boundary), state = s(j.state), method = s(j.method), target = s(j.target),
    body_digest = s(j.body_digest), status_code = n(j.status_code), attempts = n(j.attempts),
    refusals = n(j.refusals), observed_version = s(j.observed_version) ~= '' and s(j.observed_version) or '0',
    reason = s(j.reason), source = s(j.source), note = s(j.note), lease_owner = s(j.lease_owner),
    lease_expires = n(j.lease_expires), not_before = s(j.not_before), created_at = n(j.created_at),
    updated_at = n(j.updated_at), ord = n(j.ord)}
end

-- A run written before layout 2 keeps its intents in a hash of their own:
-- the first step of this layout on it moves them into the run's hash, once.
local function upgrade(run)
  local flat = call('HGETALL', K_LEGACY)
  local ord = call('LLEN', K_ORDER)
  local args = {'HSET', K_RUN}
  for i = 1, #flat, 2 do
    local it = decode_legacy(flat[i], flat[i + 1])
    args[#args + 1] = 'i:' .. it.key
    args[#args + 1] = imm_of(it)
    args[#args + 1] = 's:' .. it.key
    args[#args + 1] = mut_of(it)
    if it.ord > ord then
      ord = it.ord
    end
  end
  run.o = int(ord)
  args[#args + 1] = 'o'
  args[#args + 1] = run.o
  call(unpack(args))
  call('DEL', K_LEGACY, K_ORDER)
  -- Leases were scored by expiry; this layout scores them by -expiry.
  local leases = call('ZRANGE', K_INFLIGHT, 0, -1, 'WITHSCORES')
  for i = 1, #leases, 2 do
    call('ZADD', K_INFLIGHT, int(-tonumber(leases[i + 1])), leases[i])
  end
  loaded.o = run.o
end

-- Only the fields named (status first), or nil for a run never seen.
-- Intent fields named come with the row. A run of the old layout is moved
-- first, then read.
local function load_fields(names)
  local vals = call('HMGET', K_RUN, unpack(names))
  if not vals[1] then
    return nil
  end
  local run = {}
  loaded = {}
  for i, name in ipairs(names) do
    if vals[i] then
      run[name] = vals[i]
      loaded[name] = vals[i]
    end
  end
  if not run.o and call('HEXISTS', K_RUN, 'o') == 0 then
    upgrade(run)
    return load_fields(names)
  end
  return run
end

-- The whole row (its own fields), or nil for a run never seen.
local function load_run()
  return load_fields(ROW)
end

-- The row's own fields as a flat list for a reply.
local function flat_row(run)
  local flat = {}
  for k, v in pairs(run) do
    local c = string.byte(k, 2)
    if c ~= 58 or string.byte(k, 1) == 110 then -- not i:KEY or s:KEY (n:STATE is the row's)
      flat[#flat + 1] = k
      flat[#flat + 1] = v
    end
  end
  return flat
end

-- Server time in ms, never earlier than the run's last step (field t), so
-- the times of a run's records never go back even if the server clock does.
local function now_ms(run)
  local now = server_ms()
  if run and run.t then
    local last = tonumber(run.t)
    if last and last > now then
      now = last
    end
  end
  step_ms = now
  return now
end

-- Intent counts by state live in the row (fields n:STATE), moved in the same
-- step as the intent. A row read by fields must have read the two counts.
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

-- An event is one line of the run's audit log: "kind version from to
-- intent" (the version is the row's after the step; from, to and intent may
-- be empty) then, a line each, actor and reason, escaped as texts of a
-- record are.
local function event_line(v, actor, kind, reason, from, to, intent)
  return kind .. ' ' .. v .. ' ' .. (from or '') .. ' ' .. (to or '') .. ' ' .. (intent or '') .. '\n' ..
    esc(actor) .. '\n' .. esc(reason or '')
end

-- An entry of the audit stream is made as the arguments of its XADD:
-- add_event starts one (entry nil) or adds a line to it, a field e for
-- each, in order (Redis keeps an entry's fields in order, repeated names
-- included), and append_entry writes it. The events of an entry share one
-- time: the general rules write an entry per event; a batch writes the
-- events of all its common steps as one entry, one XADD and one entry's
-- overhead in memory for them all.
local function add_event(entry, line)
  if not entry then
    return {'XADD', K_EVENTS, '*', 'e', line}
  end
  entry[#entry + 1] = 'e'
  entry[#entry + 1] = line
  return entry
end

-- The entry's id is the step's time (id "ms-*"), not the time XADD runs
-- at: a server stopped halfway through a step (SIGSTOP) must not date the
-- step's events at its resume, after the fence was checked. Ids still
-- increase, since a step's time never goes back; a stream whose last entry
-- is later (written by an older layout, with the server's time) or a Redis
-- without "ms-*" ids takes the server's time instead.
--
-- n is the entry's length (#entry if nil: a batch refills one table for
-- every run of its call), ms_s the step's time as text (made from step_ms
-- if nil).
local function append_entry(entry, n, ms_s)
  n = n or #entry
  if step_ms then
    entry[3] = (ms_s or int(step_ms)) .. '-*'
    local id = redis.pcall(unpack(entry, 1, n))
    if type(id) ~= 'table' or not id.err then
      return
    end
    entry[3] = '*'
  end
  call(unpack(entry, 1, n))
end

local function event(run, actor, kind, reason, from, to, intent)
  append_entry(add_event(nil, event_line(run.v, actor, kind, reason, from, to, intent)))
  changed = true
end

-- next_derived_key names the next dispatch of a derived key base used
-- before: base.n, counted per base in K_SEQ (base itself was the first, so
-- the count starts at 2), skipping a name already taken (an explicit key
-- that looks derived), in the run or in staged (a batch's view of what it
-- has written and not yet saved).
local function next_derived_key(base, staged)
  local key
  repeat
    local n = call('HINCRBY', K_SEQ, base, 1)
    if n == 1 then
      n = call('HINCRBY', K_SEQ, base, 1)
    end
    key = base .. '.' .. n
  until not (staged and staged['s:' .. key]) and call('HEXISTS', K_RUN, 's:' .. key) == 0
  return key
end

-- The intent under key, or nil.
local function load_intent(key)
  local v = call('HMGET', K_RUN, 'i:' .. key, 's:' .. key)
  if not v[1] or not v[2] then
    return nil
  end
  return decode_intent(key, v[1], v[2])
end

-- Puts the intent's fields in the row, to be written with it (commit);
-- returns them, for the reply.
local function save_intent(run, it)
  local imm, mut = imm_of(it), mut_of(it)
  run['i:' .. it.key] = imm
  run['s:' .. it.key] = mut
  return {it.key, imm, mut}
end

-- The next creation ordinal of the run, kept in the row (field o).
local function next_ord(run)
  local o = (tonumber(run.o) or 0) + 1
  run.o = int(o)
  return o
end

local function new_intent(run, key, now)
  return {key = key, boundary = '', state = '', method = '', target = '', body_digest = '', status_code = 0,
    attempts = 0, refusals = 0, observed_version = '0', reason = '', source = '', note = '', lease_owner = '',
    lease_expires = 0, not_before = '', created_at = now, updated_at = now, ord = next_ord(run)}
end

-- Moves an intent on by the step itself rather than by its carrier:
-- revoked by the cancel, expired, or cut by the drain deadline.
local function force(run, it, now, actor, to, why, kind)
  local from = it.state
  it.state = to
  it.reason = why
  it.updated_at = now
  save_intent(run, it)
  count(run, from, to)
  event(run, actor, kind, why, from, to, it.key)
end

-- Every IN_FLIGHT intent whose lease expired becomes UNKNOWN: a carrier that
-- died is never taken as proof that nothing happened.
local function expire_leases(run, now, actor)
  local due = call('ZRANGEBYSCORE', K_INFLIGHT, int(-now), '+inf')
  for _, key in ipairs(due) do
    call('ZREM', K_INFLIGHT, key)
    local it = load_intent(key)
    if it and it.state == 'IN_FLIGHT' then
      force(run, it, now, actor, 'UNKNOWN', 'lease_expired', 'intent.lease_expired')
    end
  end
  local lone = run.l
  if lone and lone ~= '' then
    local it = load_intent(lone)
    if it and it.state == 'IN_FLIGHT' and it.lease_expires <= now then
      run.l = ''
      force(run, it, now, actor, 'UNKNOWN', 'lease_expired', 'intent.lease_expired')
    end
  end
end

local function move(run, now, actor, to, why)
  local from = run.status
  run.status = to
  run.status_reason = why
  run.updated = int(now)
  event(run, actor, 'run.transition', why, from, to)
end

-- Moves a CANCELLING or UNKNOWN run on, as far as its intents allow. A row
-- read by fields must have read status, drain and the IN_FLIGHT and
-- UNKNOWN counts.
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
      local cut, keys = {}, call('ZRANGE', K_INFLIGHT, 0, -1)
      if run.l and run.l ~= '' then
        keys[#keys + 1] = run.l
        run.l = ''
      end
      for _, key in ipairs(keys) do
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
      call('DEL', K_INFLIGHT)
      move(run, now, actor, 'UNKNOWN', 'drain_timeout')
    end
  elseif run.status == 'UNKNOWN' and inflight == 0 and unknown == 0 then
    move(run, now, actor, 'CANCELLED', 'reconciled')
  end
end

-- Ends a step that changed something: the row keeps the step's time (see
-- now_ms), and the fields that changed, the intents' included, are written
-- back in one HSET.
local function commit(run, now)
  if not changed then
    return
  end
  run.t = int(now)
  if run['n:IN_FLIGHT'] == '0' and not (loaded and loaded['n:IN_FLIGHT'] == '0') then
    call('ZREM', K_INFLIGHT, LEASE_MARK)
  end
  local args = {'HSET', K_RUN}
  for k, v in pairs(run) do
    if not loaded or loaded[k] ~= v then
      args[#args + 1] = k
      args[#args + 1] = v
    end
  end
  if #args > 2 then
    call(unpack(args))
  end
end

local function final(run)
  return run.status == 'CANCELLED' or run.status == 'COMPLETED'
end

-- Every operation answers one array: result ('ok', 'refused', 'conflict',
-- 'notfound', 'late'), its code (the refusal or conflict, what was not
-- found), changed (1/0), the row (a flat list of fields, as much of it as
-- the step read; false when none), the intent ({key, i:KEY, s:KEY}; false
-- when none), and a detail. (A step on the batch's common path answers the
-- same in one flat array: see batch.lua.)
local function reply(result, code, run, intent, detail)
  local row = false
  if run then
    row = flat_row(run)
  end
  return {result, code or '', changed and 1 or 0, row, intent or false, detail or ''}
end
