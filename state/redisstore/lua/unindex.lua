-- unindex: KEYS[1] the zset whose score dates an entry, then the other
-- index zsets; ARGV grace ms, run id...
-- Drops each id from every key, but only when its dated entry is older
-- than the grace or absent: a younger entry may belong to a row being
-- created (or a cancel being applied) right now, and the index script
-- refreshes the date first. The caller found each id in a state that
-- makes the entry useless (no row; an ACTIVE row in the draining set).
local t = redis.call('TIME')
local cutoff = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - tonumber(ARGV[1])
local dropped = 0
for i = 2, #ARGV do
  local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if not score or tonumber(score) < cutoff then
    for _, k in ipairs(KEYS) do
      dropped = dropped + redis.call('ZREM', k, ARGV[i])
    end
  end
end
return dropped
