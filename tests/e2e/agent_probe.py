"""The agent the end-to-end and GPU agent runs train with (`rollout.agent=agent_probe:probe`, with tests/e2e on
PYTHONPATH): three turns with tool results, written against the `openai` client, each agent recording what the
gateway answered turn by turn (the ids sent to the engine and returned) and the session's final record; by the
role in its record's metadata it also sends a diverging history, a request with a wrong key, SIGKILLs the
engine serving it (once per run: `AGENT_TEST_DIR` holds the claims) or blocks 2 s in a tool."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import openai


def claim(name):
    """True for the first agent of the run to ask (roles that must happen once)."""
    try:
        os.close(os.open(os.path.join(os.environ["AGENT_TEST_DIR"], name), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def _listening_inodes(port):
    """Inodes of the TCP sockets listening on `port` (/proc/net/tcp and tcp6: hex port, state 0A)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                inodes.add(fields[9])
    return inodes


def kill_engine(url):
    """SIGKILL the reference engine process serving `url`: the engine process holding its listening socket (an
    engine started ahead of its run gets its port later, so its command line does not name it; the driver that
    bound the socket for it holds it too)."""
    wanted = {f"socket:[{inode}]" for inode in _listening_inodes(int(url.rsplit(":", 1)[1]))}
    killed = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            if b"miles_lite.engines.reference" not in cmd:
                continue
            fds = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:
            continue
        if fds & wanted:  # the engine (and a supervisor that may hold the socket inherited)
            killed.append(int(pid))
            os.kill(int(pid), signal.SIGKILL)
    if not killed:
        raise AssertionError(f"no engine process serving {url}")
    return killed[0]


def get(url, key):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req) as resp:
        return json.loads(resp.read())


async def probe(base_url, api_key, record, sampling):
    role = (record.columns.get("metadata") or {}).get("role", "plain")
    out = {"role": role, "started": time.time()}
    session_url = base_url.rsplit("/v1", 1)[0]
    messages = [dict(m) for m in record.messages]
    turns = []
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        for turn in range(3):
            resp = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6,
                                                        extra_body={"return_token_ids": True}, **sampling)
            choice = resp.choices[0]
            turns.append({"input": resp.model_extra["prompt_token_ids"], "output": choice.model_extra["token_ids"],
                          "engine": resp.model_extra["session"]["engine"]})
            messages.append(choice.message.model_dump(exclude_none=True))
            if turn == 2:
                break
            messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": f"result {turn}"})
            if turn == 0 and role == "kill" and claim("kill"):
                out["killed"] = kill_engine(get(session_url, api_key)["engine_url"])
            if turn == 0 and role == "slow":
                start = time.time()
                time.sleep(2.0)  # a blocking tool: holds this agent's own thread
                out["slow"] = [start, time.time()]
            if turn == 1 and role == "diverge":
                bad = [dict(m) for m in messages]
                bad[1]["content"] = "another question"
                try:
                    await client.chat.completions.create(model="policy", messages=bad, max_tokens=6)
                except openai.BadRequestError as exc:
                    out["diverged"] = [exc.status_code, str(exc)]
            if turn == 0 and role == "keyless":
                async with openai.AsyncOpenAI(base_url=base_url, api_key="not-the-key", max_retries=0) as other:
                    try:
                        await other.chat.completions.create(model="policy", messages=messages, max_tokens=6)
                    except openai.AuthenticationError as exc:
                        out["keyless"] = exc.status_code
    out.update(turns=turns, record=get(session_url, api_key), done=time.time())
    out["reward"] = float(turns[-1]["output"][0] % 2)
    return out
