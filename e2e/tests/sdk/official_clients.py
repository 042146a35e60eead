"""The official `openai` and `anthropic` Python clients through the picker's proxy, each call
also sent straight to an engine: what the clients parse must be the same.

Run by `e2e/tests/real_vllm.rs` with the vLLM venv's Python (the clients are pinned in
`scripts/real-engines/requirements-vllm-cpu.lock`). Environment:
  PICKER_URL   the picker's inference listener (http://127.0.0.1:port)
  ENGINE_URL   one engine, for the same calls straight
  DOOMED_URL   the other engine, killed mid-stream at the end
  DOOMED_PGID  its process group
  MODEL        the served model name
Prints one line per check that fails and exits 1 if any did.
"""

import os
import signal
import sys
import time

import anthropic
import httpx
import openai

PICKER = os.environ["PICKER_URL"]
ENGINE = os.environ["ENGINE_URL"]
DOOMED = os.environ["DOOMED_URL"]
DOOMED_PGID = int(os.environ["DOOMED_PGID"])
MODEL = os.environ["MODEL"]

failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print(f"FAIL: {what}", flush=True)


def oai(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def ant(base):
    return anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=120)


both = {"picker": PICKER, "engine": ENGINE}
PROSE = "The quick brown fox jumps over the lazy dog while the cat sleeps by the fire. " * 6
CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": PROSE + "Summarise."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def section(name):
    print(f"--- {name}", flush=True)


# --- /v1/models: the engines' own fields -------------------------------------------------------
section("models")
listed = {k: {m.id: m for m in oai(url).models.list().data} for k, url in both.items()}
theirs, mine = listed["engine"].get(MODEL), listed["picker"].get(MODEL)
check(mine is not None, f"/v1/models through the picker lists no {MODEL}: {listed['picker']}")
if mine is not None and theirs is not None:
    for field in ("id", "object", "owned_by", "root", "parent", "max_model_len"):
        check(
            getattr(mine, field, None) == getattr(theirs, field, None),
            f"/v1/models {field}: picker {getattr(mine, field, None)!r}, "
            f"engine {getattr(theirs, field, None)!r}",
        )
    check(isinstance(mine.created, int) and mine.created > 0, f"created: {mine.created!r}")
    extra = (mine.model_extra or {}).get("kvroute") or {}
    check(extra.get("ready_endpoints") == 2, f"the pool's facts: {extra!r}")

# --- chat, completions: streamed and not, with tools -------------------------------------------
section("chat and completions")
usage = {}
for name, url in both.items():
    c = oai(url)
    r = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    check(isinstance(r.choices[0].message.content, str), f"{name} chat: {r}")
    usage[name] = r.usage.prompt_tokens
    r = c.chat.completions.create(
        model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    check(r.choices[0].finish_reason in ("length", "stop"), f"{name} chat with tools: {r}")
    usage[name, "tools"] = r.usage.prompt_tokens
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    finished = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    check(len(finished) == 1, f"{name} streamed chat: {len(finished)} chunks with finish_reason")
    check(chunks[-1].usage is not None, f"{name} streamed chat: no usage chunk")
    r = c.completions.create(model=MODEL, prompt=PROSE, max_tokens=8)
    check(isinstance(r.choices[0].text, str), f"{name} completion: {r}")
    usage[name, "completion"] = r.usage.prompt_tokens
    chunks = list(c.completions.create(model=MODEL, prompt=PROSE, max_tokens=8, stream=True))
    check(
        any(ch.choices and ch.choices[0].finish_reason for ch in chunks),
        f"{name} streamed completion never finished: {chunks[-1:]}",
    )
for key in ("chat", "tools", "completion"):
    p = usage["picker"] if key == "chat" else usage["picker", key]
    e = usage["engine"] if key == "chat" else usage["engine", key]
    check(p == e, f"{key}: prompt_tokens through the picker {p}, straight {e}")

# --- Responses: stored, chained, retrieved ----------------------------------------------------
section("responses")
c = oai(PICKER)
first = c.responses.create(model=MODEL, input=PROSE + "Go on.", max_output_tokens=8, store=True)
check(first.id.startswith("resp"), f"responses id: {first.id}")
second = c.responses.create(
    model=MODEL, input="And then?", previous_response_id=first.id, max_output_tokens=8
)
# 8 output tokens end it as `incomplete` (max_output_tokens), as on the engine
check(second.status in ("completed", "incomplete"), f"a chained response: {second.status}")
check(second.previous_response_id == first.id, f"the chain: {second.previous_response_id}")
check(c.responses.retrieve(first.id).id == first.id, "a stored response is retrieved")
try:
    c.responses.retrieve("resp_does_not_exist")
    check(False, "an unknown response id is not refused")
except openai.NotFoundError:
    pass

# --- Anthropic Messages: streamed and not, count_tokens ----------------------------------------
section("messages")
counts = {}
for name, url in both.items():
    a = ant(url)
    m = a.messages.create(
        model=MODEL,
        system="You are a terse assistant.",
        messages=[{"role": "user", "content": PROSE + "Summarise."}],
        max_tokens=8,
    )
    check(m.type == "message" and m.content[0].type == "text", f"{name} message: {m}")
    counts[name, "usage"] = m.usage.input_tokens
    with a.messages.stream(
        model=MODEL,
        messages=[{"role": "user", "content": PROSE + "Summarise."}],
        max_tokens=8,
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    check(isinstance(text, str) and final.stop_reason is not None, f"{name} stream: {final}")
    counts[name, "count"] = a.messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": PROSE}]
    ).input_tokens
for key in ("usage", "count"):
    p, e = counts["picker", key], counts["engine", key]
    check(p == e, f"messages {key}: through the picker {p}, straight {e}")

# --- typed errors, in each API's own envelope ---------------------------------------------------
section("errors")
for name, url in both.items():
    try:
        oai(url).chat.completions.create(
            model="no-such-model", messages=CHAT, max_tokens=4
        )
        check(False, f"{name}: an unknown model is not refused")
    except openai.NotFoundError as e:
        body = e.body if isinstance(e.body, dict) else {}
        check(
            {"message", "type", "param", "code"} <= set(body),
            f"{name}: OpenAI error keys {sorted(body)}",
        )
    try:
        ant(url).messages.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        check(False, f"{name}: an unknown model is not refused on /v1/messages")
    except anthropic.NotFoundError as e:
        body = e.body if isinstance(e.body, dict) else {}
        check(
            body.get("type") == "error" and set(body.get("error", {})) == {"type", "message"},
            f"{name}: Anthropic error envelope {body}",
        )
    try:
        oai(url).completions.create(model=MODEL, prompt=PROSE, max_tokens=10**7)
        check(False, f"{name}: max_tokens past the context is not refused")
    except openai.BadRequestError:
        pass

# --- a body naming no model: the engine serves its one model, the picker the pool's -----------
section("no model named")
for name, url in both.items():
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROSE, "max_tokens": 2}, timeout=60)
    check(r.status_code == 200, f"{name}: a completion naming no model: {r.status_code} {r.text[:200]}")

# --- an engine killed mid-stream: the client sees the stream break, the next call is served -----
section("engine killed mid-stream")
c = oai(PICKER)
doomed_prompt = "Only on the doomed engine. " + PROSE * 3
oai(DOOMED).completions.create(model=MODEL, prompt=doomed_prompt, max_tokens=1)
time.sleep(1.0)  # its KV events reach the picker
stream = c.completions.create(
    model=MODEL,
    prompt=doomed_prompt,
    max_tokens=4000,
    stream=True,
    extra_body={"ignore_eos": True, "min_tokens": 4000},
)
received, broke, finished = 0, False, False
try:
    for chunk in stream:
        received += 1
        if received == 3:
            os.killpg(DOOMED_PGID, signal.SIGKILL)
        if chunk.choices and chunk.choices[0].finish_reason:
            finished = True
except Exception as e:  # noqa: BLE001 - any break (a connection error, a protocol error) is expected
    broke = True
    print(f"the stream broke after {received} chunks: {type(e).__name__}: {e}", flush=True)
check(received >= 3, f"the stream gave only {received} chunks before the kill")
check(broke or not finished, "a stream whose engine was killed finished normally")
served = None
deadline = time.time() + 30
while time.time() < deadline:
    try:
        served = c.completions.create(model=MODEL, prompt=doomed_prompt, max_tokens=2)
        break
    except openai.APIError as e:
        print(f"after the kill: {type(e).__name__}: {e}", flush=True)
        time.sleep(0.5)
check(served is not None, "no request was served within 30 s after an engine was killed")

print(f"{len(failures)} failed checks", flush=True)
sys.exit(1 if failures else 0)
