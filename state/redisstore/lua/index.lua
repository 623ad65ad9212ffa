-- index: KEYS all-runs zset, live-runs zset; ARGV live (1/0), run id.
-- Runs before any script that may create the run's row, so a row never
-- exists without its index entry (see docs/redis.md). The score is the
-- server time, so a later prune can tell an old entry whose row never came
-- from one whose row is being created right now.
local t = redis.call('TIME')
local now = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
redis.call('ZADD', KEYS[1], now, ARGV[2])
if ARGV[1] == '1' then
  redis.call('ZADD', KEYS[2], now, ARGV[2])
end
return 1
