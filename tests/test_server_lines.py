"""What `edge0 serve` says on standard error: where it listens, a ready line once the model
has loaded, and an access log line per request (Edge0's log format, at the default level)."""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading

import httpx

from tests.test_server import model  # noqa: F401  (the fixture)


class _Server:
    """`edge0 serve --port 0 FLAGS` in a process of its own, its standard error read line by
    line on a thread (so that a line that never comes fails the test instead of hanging it)."""

    def __init__(self, *flags: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "edge0", "serve", "--port", "0", *flags],
                                     stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def until_ready(self) -> tuple[list[str], str]:
        """The lines up to the ready line, and the URL it names."""
        seen = []
        while True:
            try:
                line = self.lines.get(timeout=120)
            except queue.Empty:
                raise AssertionError("no ready line in 120 s: " + "".join(seen)) from None
            assert line is not None, "".join(seen)
            seen.append(line)
            if line.startswith("[edge0] ready on "):
                return seen, re.match(r"\[edge0\] ready on (\S+):", line).group(1)

    def stop(self) -> str:
        """SIGTERM; what it wrote after the ready line."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)
        rest = []
        while (line := self.lines.get(timeout=30)) is not None:
            rest.append(line)
        return "".join(rest)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _requests(url: str) -> None:
    assert httpx.get(url + "/v1/models", timeout=30).status_code == 200
    r = httpx.post(url + "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 3, "temperature": 0},
                   timeout=60)
    assert r.json()["usage"]["completion_tokens"] == 3
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}) as s:
        assert s.status_code == 200 and list(s.iter_lines())[-2:] == ["data: [DONE]", ""]
    assert httpx.get(url + "/nowhere", timeout=30).status_code == 404


def test_serve_says_when_it_is_ready_and_logs_each_request(model):  # noqa: F811
    d, _, _ = model
    with _Server("--model", str(d), "--adapter", "off") as server:
        lines, url = server.until_ready()
        assert lines[0].startswith(f"[edge0] serving {d.name} on {url} (loading")
        assert f"model {d.name} ({d};" in lines[-1]
        assert "serving POST /v1/chat/completions, /v1/completions, /v1/messages, /v1/messages/count_tokens; GET /v1/models, /health, /metrics" in lines[-1]
        _requests(url)
        log = server.stop()
    requests = [line for line in log.splitlines() if "http.request" in line]
    assert len(requests) == 4, log
    fields = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in requests]
    assert [(f["method"], f["path"], f["status"]) for f in fields] == [
        ("GET", "/v1/models", "200"), ("POST", "/v1/completions", "200"), ("POST", "/v1/chat/completions", "200"),
        ("GET", "/nowhere", "404")]
    assert fields[1]["completion_tokens"] == "3" and int(fields[1]["prompt_tokens"]) > 0
    assert fields[2]["completion_tokens"] == "2"  # a stream's line comes once it has ended
    assert all(float(f["ms"]) >= 0 for f in fields) and "prompt_tokens" not in fields[0]


def test_the_access_log_follows_the_log_format_and_can_be_turned_off(model):  # noqa: F811
    d, _, _ = model
    for flags, want in ((["--log-format", "json"], 1), (["--no-access-log"], 0)):
        with _Server("--model", str(d), "--adapter", "off", *flags) as server:
            _, url = server.until_ready()
            assert httpx.get(url + "/v1/models", timeout=30).status_code == 200
            log = server.stop()
        events = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        requests = [e for e in events if e.get("event") == "http.request"]
        assert len([line for line in log.splitlines() if "http.request" in line]) == want, log
        if want:
            assert requests[0]["path"] == "/v1/models" and requests[0]["status"] == 200
