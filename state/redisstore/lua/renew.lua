-- renew: ARGV owner, ttl ms, key...
-- Extends the leases the owner holds on IN_FLIGHT intents of one run; any
-- other intent is skipped. No event: a lease is bookkeeping, not a
-- transition.
local owner, ttl = ARGV[1], tonumber(ARGV[2])
local run = load_run()
if not run then
  return cjson.encode({renewed = 0})
end
local now = now_ms(run)
local renewed = 0
for i = 3, #ARGV do
  local it = load_intent(ARGV[i])
  if it and it.state == 'IN_FLIGHT' and it.lease_owner == owner then
    it.lease_expires = now + ttl
    save_intent(it)
    redis.call('ZADD', K_INFLIGHT, int(it.lease_expires), it.key)
    renewed = renewed + 1
  end
end
return cjson.encode({renewed = renewed})
