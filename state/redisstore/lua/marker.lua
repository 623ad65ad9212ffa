-- The store's epoch marker (marker.go): one hash, its own key, never read
-- or written by a run's programs (on Redis Cluster it lives on a slot of its
-- own). Go reads it and decides; each write here is a compare-and-set on
-- the epoch Go read, so that two instances deciding at once never undo each
-- other: the one whose expectation no longer holds gets nil and reads again.
--
-- KEYS[1]: the marker. ARGV[1]: the operation; ARGV[2]: the epoch expected
-- ('' : the marker must be absent); then field/value pairs to set.
--   create  the marker is absent: write it
--   bump    count one more check of this epoch (the answer: the new count)
--   reset   the marker is ok at that epoch: mark it reset
--   ack     the marker is reset at that epoch: acknowledge it
-- The answer is the marker's check count after the step, nil if the
-- expectation did not hold.
local op, expect = ARGV[1], ARGV[2]
local epoch = redis.call('HGET', KEYS[1], 'epoch')
if expect == '' then
  if epoch then
    return nil
  end
elseif epoch ~= expect then
  return nil
end
if op == 'reset' or op == 'ack' then
  local want = 'ok'
  if op == 'ack' then
    want = 'reset'
  end
  if redis.call('HGET', KEYS[1], 'state') ~= want then
    return nil
  end
elseif op ~= 'create' and op ~= 'bump' then
  return redis.error_reply('marker: unknown operation ' .. op)
end
if #ARGV > 2 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 3))
end
return redis.call('HINCRBY', KEYS[1], 'seq', 1)
