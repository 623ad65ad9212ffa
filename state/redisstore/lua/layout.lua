-- layout: KEYS layout marker, legacy live set, all runs, active, draining,
-- ended; ARGV the layout version.
-- Folds an index written by an older stopgate into this layout, once: the
-- live set (ACTIVE, CANCELLING and UNKNOWN runs alike) seeds both the
-- active and the draining set, and every run ever indexed enters the ended
-- set. Readers check each id's row, so an id in a set it does not belong
-- to costs a read, never a wrong answer.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return 0
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('ZUNIONSTORE', KEYS[4], 2, KEYS[4], KEYS[2], 'WEIGHTS', 0, 0)
  redis.call('ZUNIONSTORE', KEYS[5], 2, KEYS[5], KEYS[2], 'AGGREGATE', 'MIN')
  redis.call('DEL', KEYS[2])
end
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('ZUNIONSTORE', KEYS[6], 2, KEYS[6], KEYS[3], 'AGGREGATE', 'MIN')
end
redis.call('SET', KEYS[1], ARGV[1])
return 1
