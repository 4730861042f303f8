-- Frees a request's concurrency slot and corrects its token reservation to the real count.
-- KEYS: 1 log, 2 tokens, 3 sum, 4 leases (as in acquire.lua); ARGV: 1 request id, 2 actual tokens
-- Returns 1 when the request held anything, else 0.
local tokens, sum, leases = KEYS[2], KEYS[3], KEYS[4]
local request_id, actual = ARGV[1], tonumber(ARGV[2])
local held = redis.call('ZREM', leases, request_id)
local reserved = redis.call('HGET', tokens, request_id)
if reserved then
  redis.call('HSET', tokens, request_id, actual)
  redis.call('INCRBY', sum, actual - tonumber(reserved))
  held = 1
end
return held
