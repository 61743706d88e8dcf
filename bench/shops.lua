-- wrk script: respond=true decrements of qty 1 spread uniformly over SHOPS shops of
-- ITEMS items each (shops s1.., items i1..), each request with a new key. Any answer
-- other than 2xx is a failure: the items' stock is far beyond what a run can sell.
-- Each wrk thread numbers its own keys and draws from its own seed.
local counter = 0
thread_id = 0 -- a global: setup() sets it per thread
local ids = 0
local shops = tonumber(os.getenv("SHOPS") or "100")
local items = tonumber(os.getenv("ITEMS") or "100")

function setup(thread)
  ids = ids + 1
  thread:set("thread_id", ids)
end

function init(args)
  math.randomseed(thread_id * 7919)
end

request = function()
  counter = counter + 1
  local body = string.format('{"seller":"bench","item":"i%d","qty":1,"request_id":"t%d-%d"}',
    math.random(items), thread_id, counter)
  return wrk.format("POST", "/v1/shops/s" .. math.random(shops) .. "/txns",
    {["Content-Type"] = "application/json"}, body)
end

done = function(summary, latency, requests)
  io.write(string.format("non-2xx %d, socket errors %d; p50 %.2f ms, p99 %.2f ms\n",
    summary.errors.status,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    latency:percentile(50) / 1000, latency:percentile(99) / 1000))
end
