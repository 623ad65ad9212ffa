-- prune removes what retention removes of one run, under what its caller
-- read (KEYS: its seven keys; ARGV: the status and the last step's time,
-- t, it read, the time of the prune in ms, then the row's own fields): its
-- intents, counters, leases, retries and audit log leave the store; the
-- row's own fields stay (so the run can never be admitted again), with its
-- counts and the time of the prune. Answers 1 when it pruned, 0 when the
-- row is not as read (something was recorded against it since).
local function prune(KEYS, A)
  local call = redis.call
  local row = {}
  for i = 4, #A do
    row[#row + 1] = A[i]
  end
  local vals = call('HMGET', KEYS[1], unpack(row))
  local args = {'HSET', KEYS[1]}
  for i, name in ipairs(row) do
    local v = vals[i]
    if (name == 'status' and v ~= A[1]) or (name == 't' and (v or '') ~= A[2]) then
      return 0
    end
    if v then
      args[#args + 1] = name
      args[#args + 1] = v
    end
  end
  args[#args + 1] = 'pruned'
  args[#args + 1] = A[3]
  call('DEL', unpack(KEYS, 1, 7))
  call(unpack(args))
  return 1
end
