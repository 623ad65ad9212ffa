-- batch: A (the call's ARGV) g, the call's head (actor, lease owner,
-- lease ttl ms: the texts its steps mostly share, see set_head), then g
-- groups, each the steps of one run: n, then n steps, each a code and its
-- arguments: 'g' and the 8 of op_guard, 'f' (or 'l', see STEP_ARGS) and
-- the 6 of op_finish, or in upper case the same and the step's own texts.
-- KEYS: the seven per-run keys (prelude.lua) of each group's run, group
-- by group. On Redis Cluster a call holds one run (its keys are one
-- slot); on one Redis, the steps of every run queued meanwhile, so that a
-- fleet's runs share calls.
--
-- The steps run in order, in one atomic step of the server: each is still
-- its own check-and-record (or its own outcome), with its own answer, and
-- nothing can come between them. One call carries what the callers queued
-- meanwhile, so its cost (the round trip, the call itself) is shared by
-- them. A run's steps run under pcall: an error in them answers each of
-- them with {'failed', error}, and the other runs' steps of the call are
-- answered as if alone.
--
-- The common case is written out once more, for the steps of a run: the
-- row's fields they need and every record they name are read in one HMGET
-- (and, for a request repeated in a row, the names of its dispatches in two
-- more, derived_names); each step on the common path (a new effect
-- admitted on an ACTIVE run, the same request again included, or its
-- outcome) is decided against that view, which takes its changes, and adds
-- its event; their writes go out together at the end, one HSET (and one of
-- the dispatch counters), one ZADD, one ZREM, and their events as one
-- entry of the audit stream (one XADD). The first step off the common path
-- ends that: what is staged is written, and it and every step after it run
-- one by one (op_guard, op_finish), each reading afresh.

-- derived_names reads the names that the guards of each base named in a
-- row (guards: by the index of its field s:BASE in fields, how many guards
-- in a row name it) would take if each were that base again (base.n, see
-- next_derived_key): base -> list of names in order, for bases whose names
-- are all free (in the run and in view), and each listed base's counter as
-- read; nil when no guard may need one.
local function derived_names(fields, guards, view)
  local need, wanted = {}, {}
  for i, k in pairs(guards) do
    local f = fields[i]
    if not view[f] then
      -- The first guard of a base not used before takes base itself.
      k = k - 1
    end
    if k > 0 then
      need[#need + 1] = string.sub(f, 3)
      wanted[#need] = k
    end
  end
  if #need == 0 then
    return nil
  end
  local seq = call('HMGET', K_SEQ, unpack(need))
  local names, seq_at, fields, of = {}, {}, {}, {}
  for i, base in ipairs(need) do
    -- A counter not kept yet stands at 1: base itself was the first.
    local at = tonumber(seq[i]) or 1
    seq_at[base] = at
    local list = {}
    for k = 1, wanted[i] do
      local name = base .. '.' .. int(at + k)
      list[k] = name
      fields[#fields + 1] = 's:' .. name
      of[#fields] = base
    end
    names[base] = list
  end
  local held = call('HMGET', K_RUN, unpack(fields))
  for i, f in ipairs(fields) do
    if held[i] or view[f] then
      names[of[i]] = nil
    end
  end
  return names, seq_at
end

-- This file is part of the library (scripts.go), not the body of its
-- function: its tables are made once, when the library loads, and every
-- call refills them from the start, by counts it keeps. A table a call
-- makes afresh grows a key at a time, and Lua rehashes it at every power
-- of two, call after call: that was a tenth of a lone request's call. What
-- a call must not inherit, batch resets.

-- The staged writes of a run's common steps, as the arguments of an HSET,
-- a ZADD and a ZREM, refilled for each run (a fleet's call holds dozens)
-- and sent by their first elements.
local hset, zadd, zrem = {'HSET'}, {'ZADD'}, {'ZREM'}
-- The common steps' events, one entry of the audit stream with one field
-- e: their lines, three an event (event_line), joined when the run's
-- steps are written. A field an event costs an argument of the XADD, of
-- its line in the AOF and of the entry in memory; the reader tells the
-- events apart by their lines alone. Refilled for each run as the others
-- are; xadd is the XADD.
local events = {}
local xadd = {'XADD', nil, nil, 'e'}

-- kept(convert) is convert with a memory: what it gave for a value is
-- given again from a table, which costs a look-up where convert may cost
-- a thousand instructions. The values may vary without end, so the table
-- starts afresh once it holds KEPT_MAX of them.
local KEPT_MAX = 1024
local function kept(convert)
  local of, n = {}, 0
  return function(v)
    local r = of[v]
    if r == nil and v ~= nil then
      r = convert(v)
      if n == KEPT_MAX then
        of, n = {}, 0
      end
      of[v] = r
      n = n + 1
    end
    return r
  end
end

-- Steps mostly repeat their texts (actor, lease owner, an outcome's
-- reason), from call to call too: each is escaped once, since esc costs
-- two calls out of Lua. (A guard's method, target and digest come escaped
-- by its caller.)
local esc_once = kept(esc)

-- The head's actor and lease owner (set_head), escaped: what most steps
-- write.
local head_actor_e, head_owner_e

-- Numbers that come back call after call: a call's count of runs and a
-- run's of steps, the lease TTL an instance sends, a run's count of intents
-- in flight. Read from text and written as text, each costs glibc's strtod
-- or sprintf. Counts that only grow (an ordinal, a count of outcomes) are
-- not kept, as each would be kept once and never asked for again.
-- (tonumber is looked up when a call runs: a library's load may not read
-- the globals.)
local known_number = kept(function(s) return tonumber(s) end)
local known_text = kept(int)

-- The texts of the call's last guard's lease (TTL, expiry, score in the
-- lease set). A fleet's call holds a run each, and a run's steps are at
-- the call's time unless its last step was later (a clock that went
-- back), so each text is made once a call, not once a run. batch clears
-- them.
local clock_ttl, clock_lease_s, clock_lease_score

-- The state text of an intent a guard admits, "IN_FLIGHT 1 0 0 LEASE NOW -"
-- and the lease owner: the same for every guard at one time, lease and
-- owner, so made once a call for them (new_for: the three it was made
-- for). batch clears it.
local new_state, new_for_lease, new_for_now, new_for_owner

-- The call's answers, a step's at its place in the call; batch ends them
-- with a nil, where Redis stops reading (what lies beyond is an earlier
-- call's).
local answers = {}

-- The fields of the row a run's steps read (run_steps), refilled for each
-- run from the seventh, and by step where its own are; and, by an
-- outcome's count field, the last run that asked for it (its mark: the
-- call's number and its first step's offset), so that a run asks once.
local fields = {'status', 'o', 'v', 't', 'n:IN_FLIGHT', 'l'}
local field_of = {}
local counted = {}
local calls = 0

-- The outcomes' counts a run's common steps moved, by field: emptied as
-- they are written.
local moved = {}

-- run_steps runs the n steps of the run whose keys are set, the first
-- step's code at A[first], and answers them in order, the first at
-- answers[prior + 1].
local function run_steps(first, n, prior)
  local at = server_ms()
  local mark = calls * 1048576 + first

  -- The row's fields the steps read: status, ordinal, version, last time,
  -- the lone lease (LONE, prelude.lua), and the counts the common steps
  -- move, IN_FLIGHT's and each outcome's the steps name. Each element of
  -- HMGET's answer costs Lua a string and a table slot, about as much as a
  -- short step's own work. By step, field_of has where its record's field
  -- s:KEY (an outcome's, then i:KEY) or s:BASE (a guard's) is, so that no
  -- step names its fields twice.
  local nf = 6
  local o = first
  -- The guards' bases: the field s:BASE of each, and by its index, for a
  -- base that guards name in a row, how many do. The same request again
  -- names the same base, one field for them all. (A base named again after
  -- another is asked again; its later guards are then named one by one.)
  local guards, last, last_at = nil, nil, 0
  for j = 1, n do
    local code = A[o]
    if code == 'g' or code == 'G' then
      local base = A[o + 2]
      if base == last then
        guards = guards or {}
        guards[last_at] = (guards[last_at] or 1) + 1
      else
        nf = nf + 1
        fields[nf] = 's:' .. base
        last, last_at = base, nf
      end
      field_of[j] = last_at
    elseif code == 'l' or code == 'L' then
      -- An outcome nobody waits for is answered without its record: its
      -- i:KEY is not read.
      nf = nf + 1
      fields[nf] = 's:' .. A[o + 1]
      field_of[j] = nf
    else
      fields[nf + 1], fields[nf + 2] = 's:' .. A[o + 1], 'i:' .. A[o + 1]
      field_of[j] = nf + 1
      nf = nf + 2
    end
    if code ~= 'g' and code ~= 'G' then
      local count = 'n:' .. A[o + 3]
      if counted[count] ~= mark and count ~= 'n:IN_FLIGHT' then
        counted[count] = mark
        nf = nf + 1
        fields[nf] = count
      end
    end
    o = o + STEP_ARGS[code]
  end
  local vals = call('HMGET', K_RUN, unpack(fields, 1, nf))
  -- The row's six fields in the constructor: Lua sizes the table for
  -- them at once, where adding them one by one rehashes it three times.
  local view = {status = vals[1], o = vals[2], v = vals[3], t = vals[4], ['n:IN_FLIGHT'] = vals[5], l = vals[6]}
  for i = 7, nf do
    if vals[i] then
      view[fields[i]] = vals[i]
    end
  end

  local status, ver = view.status, view.v
  -- The staged writes: hset, zadd and zrem up to nh, nz and nr.
  hset[2], zadd[2], zrem[2] = K_RUN, K_INFLIGHT, K_INFLIGHT
  local nh, nz, nr = 2, 2, 2
  local ne = 0
  -- The row's own fields the common steps moved, kept as numbers and
  -- written once at the end: its ordinal (and its text, the last guard's)
  -- and IN_FLIGHT's count (nil while unmoved), and the outcomes' counts by
  -- field; and whether the lone lease moved (view.l then holds it).
  local moved_o, moved_ord, moved_inflight, moved_lone = nil, nil, nil, false

  local now = at
  local t = tonumber(view.t)
  if t and t > now then
    now = t
  end
  step_ms = now
  local now_s
  if now == at then
    now_s = clock_text
  else
    now_s = int(now)
  end
  local common = status == 'ACTIVE' and view.o ~= nil

  -- The names this call's guards of a derived base named in a row may take
  -- (base.n, see next_derived_key), read for all of them at once: two reads
  -- and, with the other writes, one write of the counters (K_SEQ) for the
  -- call, where naming each dispatch alone costs two commands. A poll
  -- repeats its request, so on its run most guards of a call are named so.
  -- A base named once in the call (three commands would not beat two), or
  -- whose next names are not all free (an explicit key that looks derived
  -- took one), is named one dispatch at a time, as the general rules do.
  local names, seq_at, named
  if common and guards then
    names, seq_at = derived_names(fields, guards, view)
    -- How many of each base's names the steps took.
    named = {}
  end

  -- A step on the common path is ok and changed, with no code or detail: it
  -- answers one string. A guard's is one line, "admitted status version
  -- key time" (the row's status and version, as op_guard's answer has
  -- them, and the step's time): everything else of the record it wrote is
  -- what its caller sent, and the caller puts it together (guardResult),
  -- so the record is neither copied here nor sent back. An outcome's is
  -- "recorded key", then a line each, i:KEY (four lines) and s:KEY; for an
  -- outcome nobody waits for ('l'), "recorded" alone. A key is printable
  -- ASCII without spaces and the records' texts are escaped, so the lines
  -- read back unambiguously. reply makes two or three
  -- tables, and even one flat table costs Redis a walk, with a look-up for
  -- every kind of answer a table may stand for, and a string for each
  -- element; one string is one concatenation here.

  -- The last guard's lease: its TTL, its expiry and its score in the lease
  -- set. An instance's guards share one TTL, so each text is made once: a
  -- run at the call's time takes up the call's (clock_ttl) and leaves it
  -- its own.
  local lease_ttl, lease_s, lease_score
  if now == at then
    lease_ttl, lease_s, lease_score = clock_ttl, clock_lease_s, clock_lease_score
  end
  -- The texts every common step of the run begins its answer or event
  -- with, made once for the run.
  local admitted_answer, admitted_event, outcome_event
  if common then
    admitted_answer = 'admitted ' .. status .. ' ' .. ver .. ' '
    admitted_event, outcome_event = 'intent.admitted ' .. ver .. '  IN_FLIGHT ', 'intent.outcome ' .. ver .. ' IN_FLIGHT '
  end
  o = first
  local j = 1
  while common and j <= n do
    local code = A[o]
    if code == 'g' or code == 'G' then
      local observed_s, base, flags = A[o + 1], A[o + 2], A[o + 3]
      local sb = fields[field_of[j]]
      local not_after = tonumber(A[o + 7])
      if not_after and at > not_after then
        answers[prior + j] = reply('late')
      elseif (view[sb] and string.byte(flags, 1) == 49) or A[o + 6] ~= '' or
          (observed_s ~= '0' and observed_s ~= ver) or A[o + 8] ~= '' then
        -- An explicit key seen before, a scheduled retry, a stale version,
        -- an edge's own refusal: the general rules.
        common = false
        break
      else
        local actor_e, owner_e, ttl = head_actor_e, head_owner_e, head_ttl
        if code == 'G' then
          actor_e, owner_e, ttl = esc_once(A[o + 9]), esc_once(A[o + 10]), A[o + 11]
        end
        local key = base
        if view[sb] then
          -- A derived base used before (the same request again).
          local list = names and names[base]
          local at_n = list and (named[base] or 0) + 1
          if list and list[at_n] then
            key = list[at_n]
            named[base] = at_n
          else
            -- A name this batch staged is taken too.
            key = next_derived_key(base, view)
          end
        end
        local ord_n = (moved_o or tonumber(view.o)) + 1
        moved_o = ord_n
        local ord = int(ord_n)
        moved_ord = ord
        if ttl ~= lease_ttl then
          lease_ttl = ttl
          lease_s = int(now + known_number(ttl))
          lease_score = '-' .. lease_s
        end
        local imm = A[o + 4] .. ' ' .. now_s .. ' ' .. ord .. ' ' .. observed_s .. '\n' .. A[o + 5]
        if not new_state or new_for_lease ~= lease_s or new_for_now ~= now_s or new_for_owner ~= owner_e then
          new_state = 'IN_FLIGHT 1 0 0 ' .. lease_s .. ' ' .. now_s .. ' -\n' .. owner_e .. '\n\n\n'
          new_for_lease, new_for_now, new_for_owner = lease_s, now_s, owner_e
        end
        local mut = new_state
        -- A base's first guard takes the base itself: its field is the
        -- one the run read.
        local ik, sk = 'i:' .. key, key == base and sb or 's:' .. key
        view[ik], view[sk] = imm, mut
        hset[nh + 1], hset[nh + 2], hset[nh + 3], hset[nh + 4] = ik, imm, sk, mut
        nh = nh + 4
        local inflight = moved_inflight or known_number(view['n:IN_FLIGHT']) or 0
        moved_inflight = inflight + 1
        if inflight == 0 and (view.l or '') == '' then
          view.l, moved_lone = key, true
        else
          zadd[nz + 1], zadd[nz + 2] = lease_score, key
          nz = nz + 2
        end
        ne = ne + 1
        events[ne] = admitted_event .. key .. '\n' .. actor_e .. '\n'
        answers[prior + j] = admitted_answer .. key .. ' ' .. now_s
      end
    else
      local key, outcome = A[o + 1], A[o + 3]
      local at_f = field_of[j]
      local sk = fields[at_f]
      local mut = view[sk]
      local from, attempts, refusals
      if mut then
        from, attempts, refusals = string.match(mut, '^(%S+) (%d+) (%d+) ')
      end
      if from ~= 'IN_FLIGHT' or attempts ~= A[o + 2] or outcome == 'IN_FLIGHT' then
        common = false
        break
      end
      local reason, source = A[o + 5], A[o + 6]
      mut = outcome .. ' ' .. attempts .. ' ' .. refusals .. ' ' .. A[o + 4] .. ' 0 ' .. now_s .. ' -\n\n' ..
        esc_once(reason) .. '\n' .. esc_once(source) .. '\n'
      view[sk] = mut
      hset[nh + 1], hset[nh + 2] = sk, mut
      nh = nh + 2
      moved_inflight = (moved_inflight or known_number(view['n:IN_FLIGHT']) or 0) - 1
      local count = 'n:' .. outcome
      moved[count] = (moved[count] or tonumber(view[count]) or 0) + 1
      if key == view.l then
        view.l, moved_lone = '', true
      else
        zrem[nr + 1] = key
        nr = nr + 1
      end
      ne = ne + 1
      events[ne] = outcome_event .. outcome .. ' ' .. key .. '\n' ..
        ((code == 'F' or code == 'L') and esc_once(A[o + 7]) or head_actor_e) .. '\n' .. esc_once(why_of(source, reason))
      if code == 'l' or code == 'L' then
        answers[prior + j] = 'recorded'
      else
        answers[prior + j] = 'recorded ' .. key .. '\n' .. view[fields[at_f + 1]] .. '\n' .. mut
      end
    end
    o = o + STEP_ARGS[code]
    j = j + 1
  end
  if now == at then
    clock_ttl, clock_lease_s, clock_lease_score = lease_ttl, lease_s, lease_score
  end
  if j > 1 then
    -- The row's fields the common steps moved, with the intents'.
    if moved_o then
      hset[nh + 1], hset[nh + 2] = 'o', moved_ord
      nh = nh + 2
    end
    if moved_inflight then
      hset[nh + 1], hset[nh + 2] = 'n:IN_FLIGHT', known_text(moved_inflight)
      nh = nh + 2
    end
    for f, v in pairs(moved) do
      hset[nh + 1], hset[nh + 2] = f, int(v)
      nh = nh + 2
      moved[f] = nil
    end
    hset[nh + 1], hset[nh + 2] = 't', now_s
    nh = nh + 2
    -- The lease set's marker (prelude.lua): added while many are in
    -- flight, with the lone lease moved in beside it (LONE), and let go
    -- with the last.
    local inflight = moved_inflight or known_number(view['n:IN_FLIGHT']) or 0
    if nz > 2 and inflight >= LEASE_MARK_AT then
      zadd[nz + 1], zadd[nz + 2] = '-inf', LEASE_MARK
      nz = nz + 2
      local lone = view.l
      if lone and lone ~= '' then
        local mut = view['s:' .. lone] or call('HGET', K_RUN, 's:' .. lone)
        local lease = mut and string.match(mut, '^IN_FLIGHT %d+ %d+ %d+ (%d+) ')
        if lease then
          zadd[nz + 1], zadd[nz + 2] = '-' .. lease, lone
          nz = nz + 2
        end
        view.l, moved_lone = '', true
      end
    elseif nr > 2 and inflight == 0 then
      zrem[nr + 1] = LEASE_MARK
      nr = nr + 1
    end
    if moved_lone then
      hset[nh + 1], hset[nh + 2] = 'l', view.l
      nh = nh + 2
    end
    if names then
      local seq = {'HSET', K_SEQ}
      for base, used in pairs(named) do
        seq[#seq + 1] = base
        seq[#seq + 1] = int(seq_at[base] + used)
      end
      if #seq > 2 then
        call(unpack(seq))
      end
    end
    call(unpack(hset, 1, nh))
    if nz > 2 then
      call(unpack(zadd, 1, nz))
    end
    if nr > 2 then
      call(unpack(zrem, 1, nr))
    end
    if ne > 0 then
      xadd[2], xadd[5] = K_EVENTS, table.concat(events, '\n', 1, ne)
      append_entry(xadd, 5, now_s)
    end
  end

  -- The rest, one by one.
  while j <= n do
    changed, loaded = false, nil
    local code = A[o]
    if code == 'g' or code == 'G' then
      answers[prior + j] = op_guard(o)
    else
      answers[prior + j] = op_finish(o)
    end
    o = o + STEP_ARGS[code]
    j = j + 1
  end
end

-- The offset after the n steps at A[first].
local function after_steps(first, n)
  local o = first
  for _ = 1, n do
    o = o + STEP_ARGS[A[o]]
  end
  return o
end

-- batch answers the call whose arguments are A and whose keys are keys.
local function batch(keys)
  calls = calls + 1
  clock_ttl, clock_lease_s, clock_lease_score = nil, nil, nil
  new_state = nil
  set_head(A[2], A[3], A[4])
  head_actor_e, head_owner_e = esc_once(A[2]), esc_once(A[3])
  local o, answered = 5, 0
  for g = 1, known_number(A[1]) do
    local n = known_number(A[o])
    local first = o + 1
    use_run(keys, (g - 1) * 7)
    local ok, err = pcall(run_steps, first, n, answered)
    if not ok then
      -- Whatever the run's steps answered before the error, the error
      -- answers them all; what the run staged and did not write is let go.
      for j = 1, n do
        answers[answered + j] = {'failed', error_text(err)}
      end
      for f in pairs(moved) do
        moved[f] = nil
      end
    end
    answered = answered + n
    o = after_steps(first, n)
  end
  answers[answered + 1] = nil
  return answers
end
