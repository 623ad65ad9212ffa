-- apply writes the steps the rules decided (package machine), under what
-- they read: it decides nothing. The call holds groups, each the steps of
-- one run in order; each step is checks, then writes. A step whose checks
-- all hold is written; the first that does not is answered stale (or
-- late, for a guard's fence), and so is every later step of its run, which
-- were decided after it: its caller reads the run and decides again.
-- Everything runs in one atomic step of the server, so nothing can come
-- between a step's checks and its writes.
--
-- KEYS: the seven keys of each group's run (keys.go), group after group,
-- then the hash of the totals the steps change (totals.go).
-- ARGV: the number of groups; then for each group the number of its
-- arguments that follow, its time (ms, the time its records carry), how
-- far (ms) the run's last step may be ahead of it, its number of steps,
-- 1 if its
-- first step moves a run of the old layout into this one (else 0), 1 if
-- it answers the row as read (the row's own fields, ROW, read first; else
-- 0, and the row is not answered), the number and names of the other
-- fields of the run's hash it reads, the number and names of the
-- derived-key counters it reads; then
-- its steps, each the number of its arguments that follow and its
-- operations, an opcode and its arguments, its checks before its writes:
--   checks  '=' field text (absent: ''), '#' field n, '>' field n and
--           '<' field n (the number is n, at least n, at most n; absent
--           reads 0),
--           '^' field prefix (absent fails), 'Q' base n (a derived-key
--           counter; absent reads 0), 'T' ms (the server's clock is not
--           past it)
--   writes  'h' field text, 'H' field text (not a step of the run: its
--           last step's time stays), '+' field n (added), 'a' field line
--           (the line added to the field's lines unless there), 'c' name n
--           (a total, added), 'o' field prefix suffix
--           (the run's next creation ordinal between them), 'q' base n
--           (a derived-key counter), 'N' score key (a lease that begins:
--           in the row's field l when it is the run's only effect in
--           flight, else in the lease set), 'L' score key (a lease
--           renewed) and 'l' key (a lease that ends), wherever it is, 'S' key and 's' key (the scheduled set), 'x' line (an
--           audit event), 'p' channel message, 'D' (the keys of a layout
--           this one replaced)
--   answer  'R' field (its value before the step's writes)
-- A field of the run's hash is any field: the row's own, i:KEY and s:KEY.
-- It answers, for each group, {results, the row as read, answers}, or
-- {'failed', error} when its steps met an error, none of them written:
-- results a letter a step (o written, s stale, l late), the values of the
-- row's own fields as read, in order (none when not asked), and each 'R' in
-- order.
-- EMPTY stands for a list or a set a group has nothing in; it is never
-- written.
local EMPTY = {}
local CHECK = {['='] = true, ['#'] = true, ['>'] = true, ['<'] = true, ['^'] = true, Q = true, T = true}
local ARITY = {['='] = 2, ['#'] = 2, ['>'] = 2, ['<'] = 2, ['^'] = 2, Q = 2, T = 1, h = 2, H = 2, ['+'] = 2, a = 2, o = 3, q = 2,
  N = 2, L = 2, l = 1, S = 1, s = 1, x = 1, p = 2, D = 0, R = 1, c = 2}

-- apply_group writes the steps of group g, whose arguments start at A[a],
-- and answers, besides, the changes of the totals it makes (nil: none).
local function apply_group(KEYS, A, g, a, clock)
  local call = redis.call
  local kb = (g - 1) * 7
  local k_run, k_legacy, k_order, k_seq, k_lease, k_sched, k_events =
    KEYS[kb + 1], KEYS[kb + 2], KEYS[kb + 3], KEYS[kb + 4], KEYS[kb + 5], KEYS[kb + 6], KEYS[kb + 7]
  local now, ahead, nsteps, moves, nf = A[a], A[a + 1], tonumber(A[a + 2]), A[a + 3] == '1', tonumber(A[a + 5])
  local nrow, fields = 0, {}
  if A[a + 4] == '1' then
    nrow, fields = #ROW, {unpack(ROW)}
  end
  a = a + 6
  for i = 1, nf do
    fields[nrow + i] = A[a + i - 1]
  end
  a = a + nf
  local nq = tonumber(A[a])
  local bases = EMPTY
  if nq > 0 then
    bases = {}
    for i = 1, nq do
      bases[i] = A[a + i]
    end
  end
  a = a + nq + 1

  -- Tables cost the interpreter more than anything else here: those most
  -- groups never need are made at their first use.
  local view, read = {}, EMPTY
  if nrow > 0 then
    read = {}
  end
  local vals = call('HMGET', k_run, unpack(fields))
  for i, f in ipairs(fields) do
    local v = vals[i]
    if v then
      view[f] = v
    end
    if i <= nrow then
      read[i] = v or false
    end
  end
  local seq = EMPTY
  if nq > 0 then
    seq = {}
    local sv = call('HMGET', k_seq, unpack(bases))
    for i, b in ipairs(bases) do
      if sv[i] then
        seq[b] = sv[i]
      end
    end
  end

  local results, changed, lines = {}, {}, {}
  local answers, quiet, qchanged, added, lease_add, lease_del, sched_add, sched_del, pubs
  local drop = false
  -- A row of the old layout (no ordinal) is moved into this one before
  -- anything else.
  local ok = moves or view.status == nil or view.o ~= nil
  -- The run's records never go back in time by more than ahead: a step
  -- decided by a clock further behind the run's last step is decided
  -- again from a read. Within it (another instance's clock a little
  -- ahead), the audit stream and the row's last step still never go
  -- back: the step is entered at the run's last step.
  local last = tonumber(view.t) or 0
  if last > tonumber(now) + tonumber(ahead) then
    ok = false
  elseif last > tonumber(now) then
    now = view.t
  end
  for j = 1, nsteps do
    local stop = a + 1 + tonumber(A[a])
    local o = a + 1
    a = stop
    local result = 'o'
    if not ok then
      result = 's'
    else
      -- The checks, against the run as the steps before left it; they
      -- come before the step's writes.
      while o < stop and CHECK[A[o]] do
        local op = A[o]
        local v = view[A[o + 1]]
        if op == '=' then
          if (v or '') ~= A[o + 2] then
            result = 's'
          end
        elseif op == '#' then
          if (tonumber(v) or 0) ~= tonumber(A[o + 2]) then
            result = 's'
          end
        elseif op == '>' then
          if (tonumber(v) or 0) < tonumber(A[o + 2]) then
            result = 's'
          end
        elseif op == '<' then
          if (tonumber(v) or 0) > tonumber(A[o + 2]) then
            result = 's'
          end
        elseif op == '^' then
          if not v or string.sub(v, 1, #A[o + 2]) ~= A[o + 2] then
            result = 's'
          end
        elseif op == 'Q' then
          if (tonumber(seq[A[o + 1]]) or 0) ~= tonumber(A[o + 2]) then
            result = 's'
          end
        elseif op == 'T' then
          if not clock.ms then
            local t = call('TIME')
            clock.ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
          end
          if clock.ms > tonumber(A[o + 1]) then
            result = 'l'
          end
        end
        if result ~= 'o' then
          break
        end
        o = o + 1 + ARITY[op]
      end
    end
    results[j] = result
    if result ~= 'o' then
      -- The later steps of the run were decided after this one.
      ok = false
    else
      while o < stop do
        local op = A[o]
        local f = A[o + 1]
        if op == 'R' then
          answers = answers or {}
          answers[#answers + 1] = view[f] or false
        elseif op == 'h' then
          view[f] = A[o + 2]
          changed[f] = true
        elseif op == 'H' then
          view[f] = A[o + 2]
          quiet = quiet or {}
          quiet[f] = true
        elseif op == 'c' then
          added = added or {}
          added[f] = (added[f] or 0) + tonumber(A[o + 2])
        elseif op == '+' then
          view[f] = string.format('%d', (tonumber(view[f]) or 0) + tonumber(A[o + 2]))
          changed[f] = true
        elseif op == 'a' then
          local lines = view[f] or '\n'
          if not string.find(lines, '\n' .. A[o + 2] .. '\n', 1, true) then
            view[f] = lines .. A[o + 2] .. '\n'
            changed[f] = true
          end
        elseif op == 'o' then
          local n = string.format('%d', (tonumber(view.o) or 0) + 1)
          view.o = n
          changed.o = true
          view[f] = A[o + 2] .. n .. A[o + 3]
          changed[f] = true
        elseif op == 'q' then
          if seq == EMPTY then
            seq = {}
          end
          seq[f] = A[o + 2]
          qchanged = qchanged or {}
          qchanged[f] = true
        elseif op == 'N' then
          -- A lease that begins: the run's only effect in flight keeps
          -- it in the row's field l, and the lease set is not written.
          local key = A[o + 2]
          if (view.l or '') == '' and tonumber(view['n:IN_FLIGHT']) == 1 then
            view.l = key
            changed.l = true
          else
            lease_add = lease_add or {}
            lease_add[#lease_add + 1] = f
            lease_add[#lease_add + 1] = key
          end
        elseif op == 'L' then
          if view.l ~= A[o + 2] then
            lease_add = lease_add or {}
            lease_add[#lease_add + 1] = f
            lease_add[#lease_add + 1] = A[o + 2]
          end
        elseif op == 'l' then
          if view.l == f then
            view.l = ''
            changed.l = true
          else
            lease_del = lease_del or {}
            lease_del[#lease_del + 1] = f
          end
        elseif op == 'S' then
          sched_add = sched_add or {}
          sched_add[#sched_add + 1] = 0
          sched_add[#sched_add + 1] = f
        elseif op == 's' then
          sched_del = sched_del or {}
          sched_del[#sched_del + 1] = f
        elseif op == 'x' then
          lines[#lines + 1] = 'e'
          lines[#lines + 1] = f
        elseif op == 'p' then
          pubs = pubs or {}
          pubs[#pubs + 1] = {f, A[o + 2]}
        elseif op == 'D' then
          drop = true
        end
        o = o + 1 + ARITY[op]
      end
    end
  end

  -- The writes of the run's steps, together.
  local hset = {'HSET', k_run}
  for f in pairs(changed) do
    hset[#hset + 1] = f
    hset[#hset + 1] = view[f]
  end
  if #hset > 2 or #lines > 0 then
    hset[#hset + 1] = 't'
    hset[#hset + 1] = now
  end
  for f in pairs(quiet or EMPTY) do
    if not changed[f] then
      hset[#hset + 1] = f
      hset[#hset + 1] = view[f]
    end
  end
  if #hset > 2 then
    call(unpack(hset))
  end
  if qchanged then
    local qset = {'HSET', k_seq}
    for b in pairs(qchanged) do
      qset[#qset + 1] = b
      qset[#qset + 1] = seq[b]
    end
    call(unpack(qset))
  end
  if lease_del then
    call('ZREM', k_lease, unpack(lease_del))
  end
  if lease_add then
    call('ZADD', k_lease, unpack(lease_add))
  end
  if sched_del then
    call('ZREM', k_sched, unpack(sched_del))
  end
  if sched_add then
    call('ZADD', k_sched, unpack(sched_add))
  end
  if drop then
    call('DEL', k_legacy, k_order)
  end
  if #lines > 0 then
    -- The entry's id is the steps' time: a server stopped halfway
    -- through (SIGSTOP) must not date them at its resume. A stream
    -- whose last entry is later (written by an older layout, with the
    -- server's time) takes the server's time instead.
    local id = redis.pcall('XADD', k_events, now .. '-*', unpack(lines))
    if type(id) == 'table' and id.err then
      call('XADD', k_events, '*', unpack(lines))
    end
  end
  for _, p in ipairs(pubs or EMPTY) do
    call('PUBLISH', p[1], p[2])
  end
  return {table.concat(results), read, answers or EMPTY}, added
end

local function apply(KEYS, A)
  local out = {}
  local clock = {}
  local totals
  local a = 2
  for g = 1, tonumber(A[1]) do
    -- A group starts with its length, so that an error in one run's
    -- steps (a key of the wrong type) answers those alone, as failed,
    -- and the other runs of the call go on.
    local n = tonumber(A[a])
    local ok, res, added = pcall(apply_group, KEYS, A, g, a + 1, clock)
    if not ok then
      if type(res) == 'table' and res.err then
        res = res.err
      end
      res = {'failed', tostring(res)}
    elseif added then
      totals = totals or {}
      for name, d in pairs(added) do
        totals[name] = (totals[name] or 0) + d
      end
    end
    out[g] = res
    a = a + 1 + n
  end
  for name, d in pairs(totals or EMPTY) do
    if d ~= 0 then
      redis.call('HINCRBY', KEYS[#KEYS], name, d)
    end
  end
  return out
end
