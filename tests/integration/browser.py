"""Headless Chromium driven over the DevTools protocol (a websocket; aiohttp's client): enough to
load a page, evaluate JavaScript in it and take a screenshot. For the dashboard's browser test."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[2]


def find_chromium() -> str | None:
    """The Chromium binary, installing Debian's package first (``install.sh --chromium``) where it
    is missing; None when it cannot be had (the test then skips, saying so)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        subprocess.run(["bash", str(ROOT / "install.sh"), "--chromium"], check=False, timeout=600)
        found = shutil.which("chromium") or shutil.which("chromium-browser")
    return found


class Page:
    """One tab's DevTools session: ``call`` sends a command and returns its result."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)

    async def call(self, method: str, timeout_s: float = 30.0, **params) -> dict:
        msg_id = next(self._ids)
        await self._ws.send_str(json.dumps({"id": msg_id, "method": method, "params": params}))
        async with asyncio.timeout(timeout_s):
            async for msg in self._ws:  # events arrive in between: skip them
                reply = json.loads(msg.data)
                if reply.get("id") == msg_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})
        raise RuntimeError(f"{method}: the DevTools connection closed")

    async def evaluate(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float, what: str):
        """Evaluate ``expression`` until it is truthy; fail naming ``what`` at the deadline."""
        deadline = time.monotonic() + timeout_s
        while not (value := await self.evaluate(expression)):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what} (last: {value!r})")
            await asyncio.sleep(0.2)
        return value

    async def screenshot(self, path: Path) -> None:
        shot = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))


@contextlib.asynccontextmanager
async def chromium_page(binary: str, profile: Path, width: int = 1400, height: int = 1300) -> AsyncIterator[Page]:
    """A headless Chromium with a blank tab, for the block. It picks its own debugging port and
    writes it to ``DevToolsActivePort`` in the profile, which we wait for."""
    profile.mkdir(parents=True, exist_ok=True)
    log = (profile / "chromium.log").open("wb")  # a pipe nobody reads would fill and stall it
    proc = subprocess.Popen(
        [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
         "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--remote-debugging-port=0",
         f"--window-size={width},{height}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=log)
    try:
        port = await _debugging_port(proc, profile / "DevToolsActivePort", timeout_s=60)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/json/list") as resp:
                tabs = [t for t in await resp.json() if t["type"] == "page"]
            async with http.ws_connect(tabs[0]["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                yield Page(ws)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


async def _debugging_port(proc: subprocess.Popen, active_port: Path, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while not (active_port.exists() and active_port.read_text().strip()):
        if proc.poll() is not None:
            log = (active_port.parent / "chromium.log").read_text(errors="replace")
            raise RuntimeError(f"chromium exited ({proc.returncode}): {log[-2000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"chromium wrote no {active_port.name} in {timeout_s:g}s")
        await asyncio.sleep(0.1)
    return int(active_port.read_text().split()[0])
