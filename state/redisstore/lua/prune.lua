-- prune: ARGV final before ms.
-- Retention for one run: when the run is final and became final before
-- the limit, its intents, counters, leases, retries and audit log leave
-- the store; the row's own fields stay (so the run can never be admitted
-- again), with its counts and the time of the prune. Returns 1 when it
-- pruned.
local before = tonumber(ARGV[1])
local vals = call('HMGET', K_RUN, unpack(ROW))
local status, updated = vals[1], vals[6]
if not (status == 'CANCELLED' or status == 'COMPLETED') then
  return 0
end
if not updated or tonumber(updated) >= before then
  return 0
end
local args = {'HSET', K_RUN}
for i, name in ipairs(ROW) do
  if vals[i] then
    args[#args + 1] = name
    args[#args + 1] = vals[i]
  end
end
args[#args + 1] = 'pruned'
args[#args + 1] = int(server_ms())
call('DEL', K_RUN, K_LEGACY, K_ORDER, K_SEQ, K_INFLIGHT, K_SCHED, K_EVENTS)
call(unpack(args))
return 1
