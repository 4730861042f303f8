-- One atomic check-and-take on an (account, model) bucket: the twin of window.py.
-- KEYS: 1 log (zset request id -> admitted at ms), 2 tokens (hash request id -> tokens),
--       3 sum (string: total tokens of the log), 4 leases (zset request id -> expiry ms)
-- ARGV: 1 now ms ("" = this server's clock), 2 window ms, 3 requests/min, 4 tokens/min,
--       5 max concurrent, 6 request id, 7 estimated tokens, 8 lease ms,
--       9 retry ms to suggest when every slot is taken
-- Returns {reason (0 admitted, 1 requests, 2 tokens, 3 concurrency, 4 duplicate id),
--          retry ms, requests in window, tokens in window, reset ms, leases held}
local log, tokens, sum, leases = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local window = tonumber(ARGV[2])
local rpm, tpm, max_concurrent = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local request_id, estimated, lease = ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8])
local concurrency_retry = tonumber(ARGV[9])

-- Entries older than the window leave it, and their tokens leave the running sum.
local cutoff = now - window
local used = tonumber(redis.call('GET', sum) or '0')
local expired = redis.call('ZRANGEBYSCORE', log, '-inf', cutoff)
for i = 1, #expired, 1000 do
  local chunk = {}
  for j = i, math.min(i + 999, #expired) do
    used = used - tonumber(redis.call('HGET', tokens, expired[j]) or '0')
    chunk[#chunk + 1] = expired[j]
  end
  redis.call('HDEL', tokens, unpack(chunk))
end
if #expired > 0 then
  redis.call('ZREMRANGEBYSCORE', log, '-inf', cutoff)
  redis.call('SET', sum, used, 'KEEPTTL')
end
redis.call('ZREMRANGEBYSCORE', leases, '-inf', now)

local function result(reason, retry)
  local count = redis.call('ZCARD', log)
  local reset = 0
  if count > 0 then
    reset = tonumber(redis.call('ZRANGE', log, -1, -1, 'WITHSCORES')[2]) + window - now
  end
  return {reason, retry, count, used, reset, redis.call('ZCARD', leases)}
end

if redis.call('HEXISTS', tokens, request_id) == 1 or redis.call('ZSCORE', leases, request_id) then
  return result(4, 0)
end

local reason, retry = 0, 0
local count = redis.call('ZCARD', log)
if count >= rpm then
  -- The entry whose departure brings the count below the limit.
  local entry = redis.call('ZRANGE', log, count - rpm, count - rpm, 'WITHSCORES')
  reason, retry = 1, tonumber(entry[2]) + window - now
end
if used + estimated > tpm then
  local need, freed, wait = used + estimated - tpm, 0, window
  local entries = redis.call('ZRANGE', log, 0, -1, 'WITHSCORES')
  for i = 1, #entries, 2 do
    freed = freed + tonumber(redis.call('HGET', tokens, entries[i]) or '0')
    if freed >= need then
      wait = tonumber(entries[i + 1]) + window - now
      break
    end
  end
  if wait > retry then
    reason, retry = 2, wait
  end
end
if redis.call('ZCARD', leases) >= max_concurrent and (reason == 0 or concurrency_retry > retry) then
  reason, retry = 3, concurrency_retry
end

if reason == 0 then
  redis.call('ZADD', log, now, request_id)
  redis.call('HSET', tokens, request_id, estimated)
  used = used + estimated
  redis.call('SET', sum, used)
  redis.call('ZADD', leases, now + lease, request_id)
  -- Nothing in the log matters a window after the newest entry, nor a lease after it expires.
  redis.call('PEXPIRE', log, window)
  redis.call('PEXPIRE', tokens, window)
  redis.call('PEXPIRE', sum, window)
  redis.call('PEXPIRE', leases, lease)
end
return result(reason, retry)
