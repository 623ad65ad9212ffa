-- steps.lua holds the two steps on every effect's path, the guard and its
-- outcome, under the general rules of docs/state-machine.md, as functions
-- of the offset o of their arguments in A (A[o] is the step's code).
--
-- They are the rules; batch.lua has the common path (a new effect admitted
-- on an ACTIVE run, and its outcome) written out once more, for any number
-- of steps of one run, and hands every step it does not recognise to these.
-- The two must give the same answers: the conformance suite runs through
-- both (statetest), and TestBatchAnswersAsStepsOneByOne compares them.

-- The texts most steps of a call share, sent once in its head (batch.lua):
-- the actor, and for a guard the lease's owner and TTL (ms). A step whose
-- code is in upper case ('G', 'F', 'L') carries its own instead, after its
-- other arguments. set_head sets them for the call.
local head_actor, head_owner, head_ttl

local function set_head(actor, owner, ttl)
  head_actor, head_owner, head_ttl = actor, owner, ttl
end

-- How many arguments a step takes, its code included. An outcome is 'f',
-- or 'l' when its caller does not wait for the record (FinishLater): the
-- same step, whose answer on the batch's common path is one word.
local STEP_ARGS = {g = 9, G = 12, f = 7, F = 8, l = 7, L = 8}

-- The actor, lease owner and TTL of the guard at A[o].
local function guard_texts(o)
  if A[o] == 'G' then
    return A[o + 9], A[o + 10], A[o + 11]
  end
  return head_actor, head_owner, head_ttl
end

-- The actor of the outcome at A[o].
local function finish_actor(o)
  if A[o] == 'F' or A[o] == 'L' then
    return A[o + 7]
  end
  return head_actor
end

-- The fields the guard reads: the row's status and version, its last
-- time, its ordinal counter and the count the guard moves.
local GUARD_FIELDS = {'status', 'o', 'v', 't', 'n:IN_FLIGHT'}

-- op_guard: A[o+1..o+8] observed version, key, flags (three characters,
-- 1/0: explicit key, auto-admit, allow cancelling), boundary, texts (the
-- method, target and body digest, escaped, a line each: the last three
-- lines of i:KEY as they are stored, made by the caller), not_before ms
-- ('' to dispatch now), not_after ms ('' for no fence), refuse (a reason
-- the edge already refused the effect for, '' for none); then, for 'G',
-- actor, lease owner and lease ttl ms (guard_texts).
-- The one atomic check-and-record of an effect: the row's status and
-- version are read and the intent written in the same step, so no cancel
-- can commit in between.
local function op_guard(o)
  local observed_s, base, flags, boundary = A[o + 1], A[o + 2], A[o + 3], A[o + 4]
  local method, target, digest = string.match(A[o + 5], '^([^\n]*)\n([^\n]*)\n([^\n]*)$')
  if not method then
    error('guard texts are not three lines: ' .. A[o + 5])
  end
  method, target, digest = unesc(method), unesc(target), unesc(digest)
  local not_before, not_after, refuse = A[o + 6], tonumber(A[o + 7]), A[o + 8]
  local actor, owner, ttl = guard_texts(o)
  ttl = tonumber(ttl)
  local explicit = string.byte(flags, 1) == 49
  local auto = string.byte(flags, 2) == 49
  local allow_cancelling = string.byte(flags, 3) == 49

  -- The fence comes before anything is read or written: a guard that Redis
  -- runs after its caller gave up (queued behind a paused server, say) must
  -- leave no trace. The server's clock decides, not the caller's.
  local at = server_ms()
  if not_after and at > not_after then
    return reply('late')
  end
  local observed = tonumber(observed_s)

  -- The row, and whether the key (or the derived base) names a record
  -- already: for an explicit key its state decides, and its count moves.
  local fields = {GUARD_FIELDS[1], GUARD_FIELDS[2], GUARD_FIELDS[3], GUARD_FIELDS[4], GUARD_FIELDS[5],
    'i:' .. base, 's:' .. base}
  if not_before ~= '' then
    fields[#fields + 1] = 'n:SCHEDULED'
  end
  local run = load_fields(fields)
  local existing, taken
  if run then
    taken = run['s:' .. base] ~= nil
    if explicit and taken then
      existing = decode_intent(base, run['i:' .. base], run['s:' .. base])
      local n = 'n:' .. existing.state
      if not run[n] then
        run[n] = call('HGET', K_RUN, n) or nil
        loaded[n] = run[n]
      end
    end
    run['i:' .. base], run['s:' .. base] = nil, nil
    loaded['i:' .. base], loaded['s:' .. base] = nil, nil
  end
  local now = at
  if run and tonumber(run.t) and tonumber(run.t) > now then
    now = tonumber(run.t)
  end
  step_ms = now
  if not run then
    if not auto then
      -- Nothing is written for a run nobody admitted.
      return reply('refused', 'run_not_admitted')
    end
    run = {status = 'ACTIVE', v = '1', o = '0', created = int(now), updated = int(now)}
    event(run, actor, 'run.admitted', 'auto-admit', '', 'ACTIVE')
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
  if not refusal and existing then
    -- state.ReplayRefusal: a record is written once per dispatch, never
    -- rewritten. Only a SCHEDULED retry guarded without a time (its
    -- dispatch) and what provably never left are dispatched again.
    local st = existing.state
    if st == 'IN_FLIGHT' or st == 'UNKNOWN' or (st == 'SCHEDULED' and not_before ~= '') then
      refusal = 'intent_in_progress'
    elseif existing.boundary ~= boundary or existing.method ~= method or existing.target ~= target or
        (digest ~= '' and existing.body_digest ~= '' and digest ~= existing.body_digest) then
      refusal = 'idempotency_key_reused'
    elseif st ~= 'SCHEDULED' and st ~= 'NOT_SENT' and st ~= 'CANCELLED_BEFORE_DISPATCH' then
      refusal = 'idempotency_key_reused'
    end
  end
  if refusal and loaded then
    -- A refusal answers with the whole row: read it now, before any change.
    run = load_run()
  end

  -- The key of a new record: a derived key is a base, each dispatch gets
  -- its own record (base for the first, base.n after), and a name already
  -- taken (an explicit key that looks derived) is skipped, never
  -- overwritten. The counter is kept only for bases used more than once.
  local function new_key()
    if explicit or not taken then
      return base
    end
    return next_derived_key(base)
  end

  if refusal then
    if existing and (refusal == 'intent_in_progress' or refusal == 'idempotency_key_reused') then
      -- The record stands as it is; the audit log keeps the attempt.
      event(run, actor, 'intent.refused', refusal, '', '', base)
      commit(run, now)
      return reply('refused', refusal, run, {base, imm_of(existing), mut_of(existing)})
    end
    local it = existing
    if it then
      -- What happened under this key stays recorded; only the refusal counts.
      it.refusals = it.refusals + 1
    else
      it = new_intent(run, new_key(), now)
      it.state = 'CANCELLED_BEFORE_DISPATCH'
      it.boundary, it.method, it.target, it.body_digest = boundary, method, target, digest
      it.observed_version = observed_s
      it.reason = refusal
      it.not_before = not_before
      count(run, nil, it.state)
    end
    local rec = save_intent(run, it)
    event(run, actor, 'intent.refused', refusal, '', 'CANCELLED_BEFORE_DISPATCH', it.key)
    commit(run, now)
    return reply('refused', refusal, run, rec)
  end

  local from = ''
  local it = existing
  if it then
    from = it.state
  else
    it = new_intent(run, new_key(), now)
  end
  it.boundary, it.method, it.target = boundary, method, target
  if digest ~= '' then
    it.body_digest = digest
  end
  it.observed_version = observed_s
  it.attempts = it.attempts + 1
  it.status_code, it.reason, it.source, it.note = 0, '', '', ''
  it.updated_at = now
  if not_before ~= '' then
    it.state = 'SCHEDULED'
    it.not_before = not_before
    it.lease_owner, it.lease_expires = '', 0
    call('ZADD', K_SCHED, int(it.ord), it.key)
  else
    it.state = 'IN_FLIGHT'
    it.not_before = ''
    it.lease_owner = owner
    it.lease_expires = now + ttl
    if from == 'SCHEDULED' then
      call('ZREM', K_SCHED, it.key)
    end
    call('ZADD', K_INFLIGHT, int(-it.lease_expires), it.key)
  end
  local rec = save_intent(run, it)
  count(run, from, it.state)
  event(run, actor, 'intent.admitted', '', from, it.state, it.key)
  commit(run, now)
  -- An admitted guard answers with the row's status and version alone.
  return reply('ok', '', {status = run.status, v = run.v}, rec)
end

-- op_finish: A[o+1..o+6] key, attempt, outcome, status code, reason,
-- source; then, for 'F', actor (finish_actor).
-- Records what happened to an IN_FLIGHT intent (or a late answer for one a
-- deadline turned UNKNOWN), then moves a cancelled run on. A repeat of a
-- finish that already landed is refused, never applied twice. Its common
-- path reads and rewrites the moving half of the record (s:KEY) alone.
local function op_finish(o)
  local key, attempt, outcome = A[o + 1], tonumber(A[o + 2]), A[o + 3]
  local code, reason, source = tonumber(A[o + 4]), A[o + 5], A[o + 6]
  local actor = finish_actor(o)
  local sk, ik = 's:' .. key, 'i:' .. key
  local run = load_fields({'status', 'o', 'v', 't', 'drain', 'n:IN_FLIGHT', 'n:UNKNOWN', 'l', 'n:' .. outcome, sk, ik})
  if not run then
    return reply('notfound', 'run')
  end
  local mut, imm = run[sk], run[ik]
  if not mut then
    return reply('notfound', 'intent')
  end
  run[sk], run[ik], loaded[sk], loaded[ik] = nil, nil, nil, nil
  local from, attempts, refusals = string.match(mut, '^(%S+) (%d+) (%d+) ')
  attempts = tonumber(attempts)
  local late = from == 'UNKNOWN' and outcome == 'RESPONDED'
  if from ~= 'IN_FLIGHT' and not late then
    return reply('conflict', 'intent_not_in_flight', load_run(), {key, imm, mut}, 'outcome ' .. outcome)
  end
  if attempt ~= attempts then
    return reply('conflict', 'stale_attempt', load_run(), {key, imm, mut},
      'report for attempt ' .. A[o + 2] .. ', latest is ' .. int(attempts))
  end
  local now = now_ms(run)
  if late then
    reason = 'late_response'
  end
  -- Nothing else of the moving half survives an outcome: the lease is
  -- let go, and an IN_FLIGHT intent has no not_before and no note.
  mut = outcome .. ' ' .. int(attempts) .. ' ' .. refusals .. ' ' .. int(code) .. ' 0 ' .. int(now) .. ' -\n\n' ..
    esc(reason) .. '\n' .. esc(source) .. '\n'
  run[sk] = mut
  if run.l == key then
    run.l = ''
  else
    call('ZREM', K_INFLIGHT, key)
  end
  count(run, from, outcome)
  event(run, actor, 'intent.outcome', why_of(source, reason), from, outcome, key)
  finalize(run, now, actor)
  commit(run, now)
  return reply('ok', '', nil, {key, imm, mut})
end
