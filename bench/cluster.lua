-- wrk script for scripts/bench-cluster.sh: decrements of qty 1 spread round-robin over
-- 20 items, each with a new key. NRTXN_BENCH_RESPOND=false sends them fire-and-forget;
-- NRTXN_BENCH_TAG keeps the keys of concurrent wrk runs apart.
local counter = 0
thread_id = 0 -- a global: setup() sets it per thread
local ids = 0
local respond = os.getenv("NRTXN_BENCH_RESPOND") or "true"
local tag = os.getenv("NRTXN_BENCH_TAG") or "w"

function setup(thread)
  ids = ids + 1
  thread:set("thread_id", ids)
end

request = function()
  counter = counter + 1
  local body = string.format(
    '{"seller":"bench","item":"i%d","qty":1,"request_id":"%s-%d-%d","respond":%s}',
    (counter + thread_id) % 20, tag, thread_id, counter, respond)
  return wrk.format("POST", "/v1/shops/flash/txns", {["Content-Type"] = "application/json"}, body)
end

done = function(summary, latency, requests)
  io.write(string.format("p50 %.2f ms, p90 %.2f ms, p99 %.2f ms, p99.9 %.2f ms\n",
    latency:percentile(50) / 1000, latency:percentile(90) / 1000,
    latency:percentile(99) / 1000, latency:percentile(99.9) / 1000))
  io.write(string.format("answered %d, non-2xx %d, errors %d\n", summary.requests,
    summary.errors.status, summary.errors.connect + summary.errors.read +
    summary.errors.write + summary.errors.timeout))
end
