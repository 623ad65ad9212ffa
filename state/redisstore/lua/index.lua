-- index: KEYS index zsets; ARGV run id, then one mode per key:
--   't' score = the server time now (refreshed on every call),
--   'n' score = the server time now if the id is not there yet (NX),
--   '0' score 0 (the set reads in id order, ZRANGE BYLEX).
-- Runs before any script that may create or end the run's row, so a row
-- never exists, and never becomes final, without its index entry (see
-- index.go). Dates come from the server's clock, as every date of a run.
local t = redis.call('TIME')
local now = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
local id = ARGV[1]
for i, k in ipairs(KEYS) do
  local mode = ARGV[i + 1]
  if mode == 't' then
    redis.call('ZADD', k, now, id)
  elseif mode == 'n' then
    redis.call('ZADD', k, 'NX', now, id)
  else
    redis.call('ZADD', k, 0, id)
  end
end
return 1
