-- Extends the leases of requests this gateway still serves; a crashed gateway stops
-- renewing and its slots free themselves when the leases run out.
-- KEYS: 1 leases; ARGV: 1 now ms ("" = this server's clock), 2 lease ms, 3.. request ids
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local expiry = now + tonumber(ARGV[2])
local renewed = 0
for i = 3, #ARGV do
  renewed = renewed + redis.call('ZADD', KEYS[1], 'XX', 'CH', expiry, ARGV[i])
end
if renewed > 0 then
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
end
return renewed
