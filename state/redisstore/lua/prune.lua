-- prune: KEYS all-runs zset, live-runs zset; ARGV grace ms, run id...
-- Drops index entries of ids the caller found without a row, but only those
-- added longer than the grace ago: a newer entry may belong to a row being
-- created right now, and the index script refreshes the score first.
local t = redis.call('TIME')
local cutoff = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - tonumber(ARGV[1])
local dropped = 0
for i = 2, #ARGV do
  for _, k in ipairs(KEYS) do
    local score = redis.call('ZSCORE', k, ARGV[i])
    if score and tonumber(score) < cutoff then
      redis.call('ZREM', k, ARGV[i])
      dropped = dropped + 1
    end
  end
end
return dropped
