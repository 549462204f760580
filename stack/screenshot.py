"""Screenshot of a table asset's Checks tab in the Dagster UI of `make run`, for the README (developer tool).

    python -m stack.screenshot --url http://127.0.0.1:3000 --out docs/checks-tab.png [--asset shop/public/orders]

Finds a table asset with asset checks (GraphQL), waits until each of its checks has a finished evaluation, opens
`/assets/<key path>?view=checks` in Debian's headless Chromium and saves the page once it shows the results.
The UI is a JS app that polls GraphQL, so the page is driven over the Chrome DevTools Protocol (a small client
on `websockets`, already installed with dagster-webserver's uvicorn) instead of `chromium --screenshot`, which
shoots at a fixed time: it can catch a check "In Progress" (the demo writer keeps runs going) and the UI's
first-visit community dialog, which only a flag in the page's localStorage keeps away.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Finished evaluations: what the Checks tab shows as results (not IN_PROGRESS, SKIPPED, EXECUTION_FAILED).
EVALUATED = {"SUCCEEDED", "FAILED"}
# How the Checks tab's list labels a check's latest execution (dagster-webserver 1.13: the status, title-cased).
RESULT_LABELS = {"Succeeded", "Failed"}
PENDING_LABELS = {"In Progress", "Not evaluated", "Skipped", "Execution Failed", "Planned"}

CHECKS_QUERY = """
{ assetNodes { assetKey { path }
    assetChecksOrError { __typename ... on AssetChecks { checks { name
      executionForLatestMaterialization { status timestamp evaluation { severity success } } } } } } }
"""


def log(msg: str) -> None:
    print(f"[screenshot] {msg}", flush=True)


# --------------------------------------------------------------------------- pure logic


def checks_path(key_path: list[str], check: str | None = None) -> str:
    """The UI's route to an asset's Checks tab (`/assets/<key path>?view=checks[&checkDetail=<check>]`)."""
    query = {"view": "checks", **({"checkDetail": check} if check else {})}
    return "/assets/" + "/".join(urllib.parse.quote(p, safe="") for p in key_path) + "?" + urllib.parse.urlencode(query)


def asset_checks(data: dict[str, Any]) -> dict[tuple[str, ...], list[dict[str, Any]]]:
    """Asset key path -> its checks, from the CHECKS_QUERY answer; assets without checks left out."""
    out: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for node in data["assetNodes"]:
        checks = (node.get("assetChecksOrError") or {}).get("checks") or []
        if checks:
            out[tuple(node["assetKey"]["path"])] = checks
    return out


def pick_asset(assets: dict[tuple[str, ...], list[dict[str, Any]]], wanted: str | None) -> tuple[str, ...]:
    """The asset to show: `wanted` ("a/b/c") if given, else the first with checks in key order."""
    if wanted is not None:
        key = tuple(wanted.split("/"))
        if key not in assets:
            known = ", ".join("/".join(k) for k in sorted(assets)) or "none"
            raise SystemExit(f"screenshot: no asset {wanted!r} with checks in the UI (assets with checks: {known})")
        return key
    if not assets:
        raise SystemExit("screenshot: no asset with checks in the UI; is `make run` serving rowrelay's code location?")
    return sorted(assets)[0]


def evaluated(checks: list[dict[str, Any]]) -> bool:
    """Every check's latest execution has finished with a result."""
    return all((c.get("executionForLatestMaterialization") or {}).get("status") in EVALUATED for c in checks)


def list_labels(text: str, name: str) -> set[str]:
    """The labels under `name` in the rendered page's text (the list shows a check's name, sometimes twice for its
    tooltip, then its latest status)."""
    lines = [line.strip() for line in text.splitlines()]
    labels: set[str] = set()
    for i, line in enumerate(lines):
        if line == name:
            j = i + 1 if i + 1 < len(lines) and lines[i + 1] != name else i + 2
            if j < len(lines):
                labels.add(lines[j])
    return labels


def page_shows_results(text: str, check_names: list[str]) -> bool:
    """The rendered Checks tab lists every check with a result and none pending, and its detail panel is not on
    a running evaluation."""
    for name in check_names:
        labels = list_labels(text, name)
        if not labels & RESULT_LABELS or labels & PENDING_LABELS:
            return False
    return "Evaluation result\nRunning" not in text


# --------------------------------------------------------------------------- Dagster UI


def graphql(base_url: str, query: str, timeout: float = 30.0, **variables: Any) -> dict[str, Any]:
    payload = {"query": query, "variables": variables}
    req = urllib.request.Request(base_url.rstrip("/") + "/graphql", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = json.loads(resp.read())
    if body.get("errors"):
        raise RuntimeError(f"GraphQL errors: {body['errors']}")
    return body["data"]


def wait_for_ui(base_url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(base_url.rstrip("/") + "/server_info", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise SystemExit(f"screenshot: no Dagster UI at {base_url} after {timeout:.0f} s ({exc}); "
                                 "start it with `make run`") from exc
        time.sleep(1.0)


def wait_for_evaluated(base_url: str, wanted: str | None, timeout: float,
                       poll_s: float = 1.0) -> tuple[tuple[str, ...], list[str]]:
    """The asset to show and its check names, once every one of its checks has a finished evaluation."""
    deadline = time.monotonic() + timeout
    while True:
        assets = asset_checks(graphql(base_url, CHECKS_QUERY))
        # Until the code location has loaded, the asset may be missing: wait for it, up to the deadline.
        if assets and (wanted is None or tuple(wanted.split("/")) in assets):
            key = pick_asset(assets, wanted)
            if evaluated(assets[key]):
                return key, sorted(c["name"] for c in assets[key])
        if time.monotonic() > deadline:
            key = pick_asset(assets, wanted)  # names what is missing
            state = {c["name"]: (c.get("executionForLatestMaterialization") or {}).get("status") for c in assets[key]}
            raise SystemExit(f"screenshot: checks of {'/'.join(key)} not evaluated within {timeout:.0f} s: {state}")
        time.sleep(poll_s)


# --------------------------------------------------------------------------- Chromium over CDP


class Page:
    """One Chromium tab over the DevTools Protocol: commands by id, events ignored."""

    def __init__(self, ws: Any) -> None:
        self._ws = ws  # a websockets.sync ClientConnection
        self._next = 0

    def call(self, method: str, timeout: float = 60.0, **params: Any) -> dict[str, Any]:
        self._next += 1
        self._ws.send(json.dumps({"id": self._next, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            msg = json.loads(self._ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if msg.get("id") == self._next:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def text(self) -> str:
        result = self.call("Runtime.evaluate", expression="document.body ? document.body.innerText : ''",
                           returnByValue=True)
        return str(result.get("result", {}).get("value", ""))


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise SystemExit("screenshot: no chromium on PATH (Debian: apt-get install chromium)")


@contextlib.contextmanager
def chromium(width: int, height: int, timeout: float = 60.0) -> Iterator[Page]:
    """Headless Chromium with a throw-away profile; yields a blank tab."""
    profile = Path(tempfile.mkdtemp(prefix="rowrelay-chromium-"))
    argv = [chromium_binary(), "--headless=new", f"--window-size={width},{height}", "--hide-scrollbars",
            "--disable-gpu", "--no-first-run", "--no-default-browser-check", "--disable-extensions",
            f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank"]
    if os.geteuid() == 0:  # Chromium refuses to run as root with its sandbox on
        argv.insert(1, "--no-sandbox")
    # Chromium's stderr is D-Bus noise on a headless box; kept in the profile dir in case the launch fails.
    with open(profile / "chromium.log", "wb") as errlog:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errlog,
                                start_new_session=True)
    try:
        port_file = profile / "DevToolsActivePort"  # written once the DevTools server listens (on a free port)
        deadline = time.monotonic() + timeout
        while not port_file.exists() or len(port_file.read_text().splitlines()) < 2:
            if proc.poll() is not None or time.monotonic() > deadline:
                errors = (profile / "chromium.log").read_text(errors="replace")[-2000:]
                raise SystemExit(f"screenshot: chromium did not start: {errors}")
            time.sleep(0.2)
        port = port_file.read_text().splitlines()[0].strip()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
            targets = [t for t in json.loads(resp.read()) if t.get("type") == "page"]
        from websockets.sync.client import connect

        # max_size: a screenshot exceeds the 1 MiB default message size.
        with connect(targets[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=30) as ws:
            page = Page(ws)
            # The exact viewport, whatever window decorations headless mode assumes.
            page.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                      mobile=False)
            yield page
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)


def rendered(text: str, check_names: list[str]) -> bool:
    """The Checks tab has drawn its list: every check with some label, and the detail panel's latest execution."""
    return all(list_labels(text, n) & (RESULT_LABELS | PENDING_LABELS) for n in check_names) and \
        "Evaluation result" in text


def shoot(base_url: str, key: tuple[str, ...], check: str | None, out: Path, width: int, height: int,
          timeout: float) -> str:
    """Open the Checks tab right after the checks have finished evaluating and save it once it shows their results.
    The demo writer keeps runs going, and a run marks its checks "In Progress" for most of its life, so this
    may take a few tries: each waits for the next finished evaluation and reloads. Returns the page's text as
    shot."""
    url = base_url.rstrip("/") + checks_path(list(key), check)
    wanted = "/".join(key)
    deadline = time.monotonic() + timeout
    with chromium(width, height) as page:
        page.call("Page.enable")
        # The UI shows a "Join the Dagster community" dialog on a first visit from 127.0.0.1 unless this is set.
        page.call("Page.addScriptToEvaluateOnNewDocument",
                  source="try { localStorage.setItem('communityNux', JSON.stringify('1')); } catch (e) {}")
        attempt = 0
        while True:
            attempt += 1
            _, names = wait_for_evaluated(base_url, wanted, max(1.0, deadline - time.monotonic()), poll_s=0.25)
            page.call("Page.navigate", url=url)
            text, shown_by = "", time.monotonic() + 20
            while time.monotonic() < shown_by:
                time.sleep(0.25)
                text = page.text()
                if rendered(text, names):
                    break
            if page_shows_results(text, names):
                time.sleep(1.0)  # the status icons and the metadata table settle
                data = page.call("Page.captureScreenshot", format="png")["data"]
                text = page.text()
                if page_shows_results(text, names):  # no run re-marked a check while the shot was taken
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"screenshot: the Checks tab never showed finished checks in {timeout:.0f} s; "
                                 f"last page text:\n{text[:2000]}")
            log(f"try {attempt}: a check was pending again when the page loaded (the demo keeps runs going); retrying")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(base64.b64decode(data))
    log(f"saved {out} ({out.stat().st_size:,} bytes, {width}x{height}) of {url}, try {attempt}")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stack.screenshot", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:3000", help="the Dagster UI (default %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("docs/checks-tab.png"), help="PNG to write")
    parser.add_argument("--asset", help="asset key path, e.g. shop/public/orders (default: first with checks)")
    parser.add_argument("--check", help="check to open in the detail panel (default: the UI's first)")
    parser.add_argument("--window-size", default="1440,900", help="W,H in CSS pixels (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the UI and checks")
    args = parser.parse_args(argv)
    width, height = (int(v) for v in args.window_size.split(","))
    wait_for_ui(args.url, args.timeout)
    key, names = wait_for_evaluated(args.url, args.asset, args.timeout)
    log(f"asset {'/'.join(key)}: checks {', '.join(names)} evaluated")
    shoot(args.url, key, args.check, args.out, width, height, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
