-- Takes back reservations whose acquire timed out: the script may still have run when
-- the reply was lost, and a refused (or locally admitted) request must not hold a share.
-- KEYS: 1 log, 2 tokens, 3 sum, 4 leases (as in acquire.lua); ARGV: request ids
-- Returns how many were found and removed.
local log, tokens, sum, leases = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local removed = 0
for i = 1, #ARGV do
  local reserved = redis.call('HGET', tokens, ARGV[i])
  if reserved then
    redis.call('HDEL', tokens, ARGV[i])
    redis.call('DECRBY', sum, tonumber(reserved))
    removed = removed + 1
  end
  redis.call('ZREM', log, ARGV[i])
  redis.call('ZREM', leases, ARGV[i])
end
return removed
