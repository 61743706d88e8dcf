-- wrk script: respond=true decrements of qty 1 on one hot item, each with a new key.
-- Each wrk thread numbers its own keys; the thread id keeps them apart.
local counter = 0
thread_id = 0 -- a global: setup() sets it per thread
local ids = 0

function setup(thread)
  ids = ids + 1
  thread:set("thread_id", ids)
end

request = function()
  counter = counter + 1
  local body = string.format(
    '{"seller":"bench","item":"hot","qty":1,"request_id":"t%d-%d"}', thread_id, counter)
  return wrk.format("POST", "/v1/shops/flash/txns", {["Content-Type"] = "application/json"}, body)
end

local statuses = {}
response = function(status, headers, body)
  local s = string.match(body, '"status":"([a-z_]+)"') or tostring(status)
  statuses[s] = (statuses[s] or 0) + 1
end

done = function(summary, latency, requests)
  -- statuses are per thread state and cannot be summed here; the server reports them.
  io.write(string.format("p50 %.2f ms, p90 %.2f ms, p99 %.2f ms, p99.9 %.2f ms\n",
    latency:percentile(50) / 1000, latency:percentile(90) / 1000,
    latency:percentile(99) / 1000, latency:percentile(99.9) / 1000))
end
