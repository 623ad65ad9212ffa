-- renew: ARGV owner, ttl ms, key...
-- Extends the leases the owner holds on IN_FLIGHT intents of one run; any
-- other intent is skipped. No event: a lease is bookkeeping, not a
-- transition. The reply carries the row, so the carrier learns of a cancel
-- in the same round trip, and after it every intent renewed.
local owner, ttl = ARGV[1], tonumber(ARGV[2])
local run = load_run()
if not run then
  return reply('notfound', 'run')
end
local now = now_ms(run)
local out = reply('ok', '', run)
local args = {'HSET', K_RUN}
for i = 3, #ARGV do
  local it = load_intent(ARGV[i])
  if it and it.state == 'IN_FLIGHT' and it.lease_owner == owner then
    it.lease_expires = now + ttl
    local rec = save_intent({}, it)
    args[#args + 1] = 's:' .. it.key
    args[#args + 1] = rec[3]
    if it.key ~= run.l then
      call('ZADD', K_INFLIGHT, int(-it.lease_expires), it.key)
    end
    out[#out + 1] = rec
  end
end
if #args > 2 then
  call(unpack(args))
end
return out
