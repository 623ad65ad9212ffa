-- renew: ARGV owner, ttl ms, key...
-- Extends the leases the owner holds on IN_FLIGHT intents of one run; any
-- other intent is skipped. No event: a lease is bookkeeping, not a
-- transition. The reply carries the row, so the carrier learns of a cancel
-- in the same round trip.
local owner, ttl = ARGV[1], tonumber(ARGV[2])
local run = load_run()
if not run then
  return cjson.encode({})
end
local now = now_ms(run)
local renewed = {}
for i = 3, #ARGV do
  local it = load_intent(ARGV[i])
  if it and it.state == 'IN_FLIGHT' and it.lease_owner == owner then
    it.lease_expires = now + ttl
    save_intent(it)
    redis.call('ZADD', K_INFLIGHT, int(it.lease_expires), it.key)
    renewed[#renewed + 1] = it
  end
end
if #renewed == 0 then
  -- cjson writes an empty table as {}, which is not a list.
  renewed = nil
end
return cjson.encode({run = run, renewed = renewed})
