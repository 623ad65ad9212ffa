-- read takes what the rules of a step ask of a run (package machine's
-- View), in one atomic step of the server, so that what it answers is one
-- state of the run: the row's own fields, the records named, the
-- derived-key counters named, and, when asked, the records in the lease
-- set and the scheduled set. It writes nothing.
--
-- KEYS: the seven keys of each group's run, group after group. ARGV: the
-- number of groups; then for each group the number of its arguments that
-- follow, the fields of the run's hash to
-- read besides the row's own (ROW, always read first; their number, then
-- them: l and i:KEY, s:KEY of the records named), the derived-key counters (number, then bases), and two
-- flags, 1 or 0: the lease set's records, the scheduled set's.
-- It answers, for each group, {fields' values, counters' values, lease
-- set (member, score, ...; a lone lease of an older layout scored 'lone')
-- and its records' i:KEY s:KEY (flat), scheduled
-- set members and their records, the old layout's intents (key, JSON, ...;
-- only for a row without its ordinal field o)}.
local function read(KEYS, A)
  local call = redis.call
  local out = {}
  local a = 2
  local function read_group(g, a)
    local kb = (g - 1) * 7
    local k_run, k_legacy, k_seq, k_lease, k_sched = KEYS[kb + 1], KEYS[kb + 2], KEYS[kb + 4], KEYS[kb + 5], KEYS[kb + 6]
    local nf = tonumber(A[a])
    local nrow = #ROW
    local fields = {unpack(ROW)}
    for i = 1, nf do
      fields[nrow + i] = A[a + i]
    end
    a = a + nf + 1
    local nq = tonumber(A[a])
    local bases = {}
    for i = 1, nq do
      bases[i] = A[a + i]
    end
    a = a + nq + 1
    local want_leases, want_sched = A[a] == '1', A[a + 1] == '1'
    a = a + 2

    local vals = call('HMGET', k_run, unpack(fields))
    local seq = {}
    if nq > 0 then
      seq = call('HMGET', k_seq, unpack(bases))
    end
    local function records(members)
      local names = {}
      for _, m in ipairs(members) do
        names[#names + 1] = 'i:' .. m
        names[#names + 1] = 's:' .. m
      end
      if #names == 0 then
        return {}
      end
      return call('HMGET', k_run, unpack(names))
    end
    local leases, lease_recs, sched, sched_recs = {}, {}, {}, {}
    if want_leases then
      leases = call('ZRANGE', k_lease, 0, -1, 'WITHSCORES')
      -- The lone lease: the run's only effect in flight when it began,
      -- kept in the row's field l (lua/apply.lua's N).
      local lone = call('HGET', k_run, 'l')
      if lone and lone ~= '' then
        leases[#leases + 1] = lone
        leases[#leases + 1] = 'lone'
      end
      local members = {}
      for i = 1, #leases, 2 do
        members[#members + 1] = leases[i]
      end
      lease_recs = records(members)
    end
    if want_sched then
      sched = call('ZRANGE', k_sched, 0, -1)
      sched_recs = records(sched)
    end
    local legacy = {}
    if call('HEXISTS', k_run, 'o') == 0 and call('EXISTS', k_run) == 1 then
      legacy = call('HGETALL', k_legacy)
    end
    return {vals, seq, leases, lease_recs, sched, sched_recs, legacy}
  end
  for g = 1, tonumber(A[1]) do
    -- Each run on its own: an error reading one (a key of the wrong
    -- type) answers that run alone, as failed.
    local n = tonumber(A[a])
    local ok, res = pcall(read_group, g, a + 1)
    if not ok then
      if type(res) == 'table' and res.err then
        res = res.err
      end
      res = {'failed', tostring(res)}
    end
    out[g] = res
    a = a + 1 + n
  end
  return out
end
