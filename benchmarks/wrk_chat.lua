-- wrk script for bench_proxy.py --client wrk: chat completions whose prompts share one of N system prefixes.
--
--   wrk -t1 -cC -dDs --latency -s benchmarks/wrk_chat.lua URL -- PROMPT_BYTES PREFIXES VARIANTS MAX_REQUESTS MODEL
--
-- Each body is a system message (half the prompt bytes, one of PREFIXES distinct texts) and a user message (the
-- other half, one of VARIANTS questions per prefix), so a cache-aware router sees PREFIXES groups of requests that
-- share their first half. The PREFIXES * VARIANTS bodies are built once in init() and sent in turn, so the load
-- generator spends nothing per request on building them. After MAX_REQUESTS answers the thread stops (wrk's -d is
-- the time bound). done() prints one line, "WRK_JSON {...}", with requests/s (answers over the time from the first
-- request to the last answer) and wrk's latency distribution in ms. Needs wrk built with LuaJIT (for ffi).
-- Prompts are plain ASCII: no JSON escaping is needed.

local ffi = require("ffi")
ffi.cdef [[
  typedef struct { long tv_sec; long tv_nsec; } shoal_timespec;
  int clock_gettime(int clock_id, shoal_timespec *tp);
]]
local CLOCK_MONOTONIC = 1
local timespec = ffi.new("shoal_timespec")

local function now_s()
  ffi.C.clock_gettime(CLOCK_MONOTONIC, timespec)
  return tonumber(timespec.tv_sec) + tonumber(timespec.tv_nsec) / 1e9
end

local bodies = {}
local next_body = 1
local max_requests = 0
-- Per thread, read by done() through thread:get(): wrk's own duration is always the whole -d, even when the
-- thread stopped at MAX_REQUESTS, so the rate is answers over the time from the first request to the last answer.
answers = 0
first_request_s = 0
last_answer_s = 0
local threads = {}

function setup(thread)
  threads[#threads + 1] = thread
end

local function repeat_to(text, size)
  local out = string.rep(text, math.ceil(size / #text))
  return string.sub(out, 1, size)
end

function init(args)
  local prompt_bytes = tonumber(args[1] or "2048")
  local prefixes = tonumber(args[2] or "48")
  local variants = tonumber(args[3] or "16")
  max_requests = tonumber(args[4] or "0")
  local model = args[5] or "shoal-demo"
  local system_bytes = math.floor(prompt_bytes / 2)
  for p = 1, prefixes do
    local system = repeat_to(string.format("You are assistant %d of the fleet; answer briefly and exactly. ", p),
      system_bytes)
    for v = 1, variants do
      local question = repeat_to(string.format("Question %d for prefix %d: what is %d times %d? ", v, p, v, p + 7),
        prompt_bytes - system_bytes)
      bodies[#bodies + 1] = string.format(
        '{"model":"%s","max_tokens":8,"stream":false,"messages":[{"role":"system","content":"%s"},'
          .. '{"role":"user","content":"%s"}]}',
        model, system, question)
    end
  end
  -- Interleave the prefixes (1, 2, ..., N, 1, 2, ...) rather than sending one prefix's variants back to back.
  local ordered = {}
  for v = 1, variants do
    for p = 1, prefixes do
      ordered[#ordered + 1] = bodies[(p - 1) * variants + v]
    end
  end
  bodies = ordered
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
end

function request()
  if first_request_s == 0 then
    first_request_s = now_s()
  end
  local body = bodies[next_body]
  next_body = next_body % #bodies + 1
  return wrk.format(nil, nil, nil, body)
end

function response(status, headers, body)
  answers = answers + 1
  last_answer_s = now_s()
  if max_requests > 0 and answers >= max_requests then
    wrk.thread:stop()
  end
end

function done(summary, latency, requests)
  local errors = summary.errors
  local num_answers, first_s, last_s = 0, math.huge, 0
  for _, thread in ipairs(threads) do
    num_answers = num_answers + thread:get("answers")
    first_s = math.min(first_s, thread:get("first_request_s"))
    last_s = math.max(last_s, thread:get("last_answer_s"))
  end
  local seconds = math.max(last_s - first_s, 1e-9)
  local function ms(p)
    return latency:percentile(p) / 1000
  end
  io.write(string.format(
    'WRK_JSON {"num_requests":%d,"elapsed_s":%.6f,"requests_per_s":%.3f,"p50_ms":%.3f,"p90_ms":%.3f,'
      .. '"p99_ms":%.3f,"p999_ms":%.3f,"max_ms":%.3f,"mean_ms":%.3f,"errors_connect":%d,"errors_read":%d,'
      .. '"errors_write":%d,"errors_status":%d,"errors_timeout":%d}\n',
    num_answers, seconds, num_answers / seconds, ms(50), ms(90), ms(99), ms(99.9), latency.max / 1000,
    latency.mean / 1000, errors.connect, errors.read, errors.write, errors.status, errors.timeout))
end
