-- Registers this gateway as live and counts the live ones (those seen within the TTL).
-- KEYS: 1 gateways (zset gateway id -> expiry ms); ARGV: 1 now ms ("" = server clock),
--       2 ttl ms, 3 gateway id
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return redis.call('ZCARD', KEYS[1])
