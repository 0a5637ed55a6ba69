"""The inspector in a real server process (`deltaserve inspect`, the serving app with the inspector
mounted): the live view's SSE stream while a batch of requests runs through /v1, and a headless Chromium
(Debian's /usr/bin/chromium driven by Playwright; no browser download) using the page."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from deltaserve.assets import DEMO_DIR
from tests.checkpoints import RATIOS_27B, random_hf_model, save_official_layout

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """A random checkpoint with the 27B's layer pattern and the demo tokenizer (so Chinese text splits as
    it would on the demo model), served by `deltaserve inspect`."""
    path = tmp_path_factory.mktemp("ckpt")
    save_official_layout(random_hf_model(dict(RATIOS_27B, vocab_size=8192), seed=5), path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO_DIR / name, path / name)
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(path / "server.log", "w")  # noqa: SIM115  (closed after the process)
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltaserve.cli", "inspect", str(path), "--port", str(port),
         "--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "48"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{base}/inspect/api/model", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.close()
            pytest.fail(f"server did not start:\n{(path / 'server.log').read_text()[-3000:]}")
        time.sleep(0.2)
    yield base
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def _send_batch(base: str, n: int, max_tokens: int, first_max_tokens: int | None = None) -> list[int]:
    """n completions at once; the first may run longer (first_max_tokens)."""
    codes: list[int] = []

    def one(i: int) -> None:
        tokens = first_max_tokens if i == 0 and first_max_tokens else max_tokens
        r = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "prompt": f"请求 {i}: " + "猫坐在垫上。" * (2 + i), "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True,
        })
        codes.append(r.status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return codes


def test_live_view_streams_real_engine_steps(server: str) -> None:
    events: list[dict] = []
    status: list[dict] = []
    done = threading.Event()

    client = httpx.Client(timeout=30)

    def listen() -> None:
        try:
            with client.stream("GET", f"{server}/inspect/api/live") as r:
                name = None
                for line in r.iter_lines():
                    if line.startswith("event: "):
                        name = line[7:]
                    elif line.startswith("data: "):
                        (status if name == "status" else events).append(json.loads(line[6:]))
                    if done.is_set():
                        return
        except httpx.HTTPError:
            pass  # closed from the test's side

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not status and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status, "no status event from /inspect/api/live"
    assert status[0]["budget"] == 48 and status[0]["spec"] == {"enabled": False}
    # One request runs on after the others, so that the newest event of some batch (the one that carries
    # the block maps) comes while it still holds blocks, however fast this machine steps.
    codes = _send_batch(server, 6, max_tokens=12, first_max_tokens=200)
    assert codes == [200] * 6, codes
    time.sleep(0.5)  # the last batch of events is sent within ~0.1 s
    done.set()
    client.close()
    assert events, "no step events while requests ran"
    kinds = {s["kind"] for e in events for s in e["scheduled"]}
    assert kinds == {"prefill", "decode"}
    assert all(e["num_tokens"] <= e["budget"] == 48 for e in events)
    assert any(len(e["scheduled"]) > 1 for e in events), "requests never shared a step"
    steps = [e["step"] for e in events]
    assert steps == sorted(steps)
    with_maps = [e for e in events if "blocks" in e]
    assert any(e["blocks"] for e in with_maps) and any(e["slots"] for e in with_maps)
    for e in with_maps:  # a block belongs to one request at a time
        owned = [b for blocks in e["blocks"].values() for b in blocks]
        assert len(owned) == len(set(owned)) and all(0 <= b < e["num_blocks"] for b in owned)


def test_trace_api_over_http(server: str) -> None:
    r = httpx.post(f"{server}/inspect/api/trace", json={"prompt": "猫坐在垫上"}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [t["text"] for t in body["tokens"]][:3] == ["猫", "坐", "在"]
    bad = httpx.get(f"{server}/inspect/api/gdn_state", params={"trace": body["trace_id"], "layer": 3})
    assert bad.status_code == 400 and "not a GDN layer" in bad.json()["error"]["message"]
    gone = httpx.get(f"{server}/inspect/api/attention", params={"trace": "nope", "layer": 3})
    assert gone.status_code == 404
    # It plans every known shape on the meta device: seconds on a loaded machine, past httpx's 5 s default.
    plan = httpx.get(f"{server}/inspect/api/plan", params={"tp": 4, "kv_cache_dtype": "fp8"}, timeout=120).json()
    by_name = {p["name"]: p for p in plan["plans"]}
    # 4 KV heads / 4, one byte a value and an fp32 scale of each K and V row
    assert by_name["Qwen3.5-27B (bf16)"]["kv_bytes_per_token_per_layer"] == 2 * 1 * (256 + 4)
    assert "error" in by_name["loaded model"]  # 6 heads do not split over 4 ranks: said, not crashed


def _browser():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium); the browser test needs it")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (test extra) is not installed")
    return sync_api


@contextlib.contextmanager
def english_page(base: str, errors: list[str]) -> Iterator[Any]:
    """The inspector of the server at `base` in a headless Chromium, loaded and in English whatever the
    locale; the page's errors are appended to `errors`."""
    sync_api = _browser()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 1000}, locale="en-US")
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.set_default_timeout(15000)
            page.goto(f"{base}/inspect")
            page.wait_for_selector("body[data-ready='1']")
            if page.text_content("#lang-toggle") == "English":
                page.click("#lang-toggle")
            yield page
        finally:
            browser.close()


def screenshots_dir(tmp_path: Path) -> Path:
    shots = Path(os.environ.get("DELTASERVE_SCREENSHOTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    return shots


def test_page_in_headless_chromium(server: str, tmp_path: Path) -> None:
    shots = screenshots_dir(tmp_path)
    errors: list[str] = []
    with english_page(server, errors) as page:
        page.fill("#prompt", "猫坐在垫上。The cat sat.")
        page.click("#run-trace")
        page.wait_for_selector("#layer-table tr.layer-row")
        types = page.eval_on_selector_all("#layer-table tr.layer-row",
                                          "rs => rs.map(r => r.dataset.type)")
        assert types == ["gdn", "gdn", "gdn", "attention"] * 2
        chips = page.eval_on_selector_all("#tokens .tok", "ts => ts.length")
        assert chips >= 8
        page.click("#layer-table tr.layer-row[data-layer='3']")
        page.wait_for_selector("#layer-detail [data-layer='3'] #ops")
        assert "softmax" in page.text_content("#layer-detail")
        page.select_option("#tp", "2")
        page.wait_for_selector("#layer-detail [data-layer='3'][data-tp='2'] #ops")
        page.screenshot(path=str(shots / "trace.png"), full_page=True)

        page.click("nav button[data-tab=gdn]")
        page.wait_for_selector("#gdn-states canvas")
        assert page.eval_on_selector_all("#gdn-states .state-card", "c => c.length") == chips
        page.select_option("#gdn-head", "5")
        page.wait_for_function("document.querySelector('#gdn-head').value === '5'")
        page.screenshot(path=str(shots / "gdn.png"), full_page=True)

        page.click("nav button[data-tab=attn]")
        page.wait_for_selector("#rope")
        assert page.eval_on_selector_all(".head-card[data-head]", "c => c.length") == 6
        page.screenshot(path=str(shots / "attention.png"), full_page=True)

        page.click("#lang-toggle")  # to Chinese
        page.wait_for_function(
            "document.querySelector('nav button[data-tab=attn]').textContent === '注意力实验台'"
        )
        assert "注意力权重" in page.text_content("#attn-out")
        page.click("nav button[data-tab=plan]")
        page.wait_for_selector("#plan-table")
        assert "Qwen3.5-27B" in page.text_content("#plan-table")
        page.click("nav button[data-tab=live]")
        page.wait_for_selector("#live-conn")
        page.wait_for_function("document.querySelector('#live-conn').textContent.includes('已连接')")
        threading.Thread(target=_send_batch, args=(server, 4, 48), daemon=True).start()
        page.wait_for_selector("#live-step:not([data-running='0']) #budget-bar")
        page.wait_for_selector("#block-grid")
        page.wait_for_selector("#prefix-stats")  # prefix caching is on by default
        assert "GDN 快照" in page.text_content("#prefix-cache")
        page.screenshot(path=str(shots / "live_zh.png"), full_page=True)
    assert not errors, errors


def test_page_renders_chinese_has_a_favicon_and_plans_the_engines_tp(server: str) -> None:
    """Chinese must render as glyphs, not the boxes of a missing font: two different characters drawn in
    the page's own font differ pixel for pixel only when a font has them (every missing glyph is the same
    box). The plan form starts at the engine's TP (1 here), so the loaded model's column is filled in."""
    plan = httpx.get(f"{server}/inspect/api/plan", timeout=30).json()
    assert plan["inputs"]["tp"] == 1 and "error" not in plan["plans"][0]
    icon = httpx.get(f"{server}/favicon.ico", timeout=30)
    assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg+xml")
    sync_api = _browser()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 1000})
            page.goto(f"{server}/inspect")
            page.wait_for_selector("body[data-ready='1']")
            assert page.get_attribute("link[rel=icon]", "href") == "/inspect/static/favicon.svg"
            same = page.evaluate("""() => {
                const font = getComputedStyle(document.body).font;
                const draw = (ch) => {
                    const c = document.createElement("canvas"); c.width = 40; c.height = 40;
                    const g = c.getContext("2d"); g.font = font.replace(/\\d+px/, "32px"); g.fillText(ch, 2, 32);
                    return Array.from(g.getImageData(0, 0, 40, 40).data).join(",");
                };
                return draw("猫") === draw("狗");
            }""")
            assert not same, "Chinese renders as boxes: no CJK font (.ci/run installs fonts-wqy-microhei)"
            page.click("nav button[data-tab=plan]")
            page.wait_for_selector("#plan-table")
            assert page.input_value("#plan-tp") == "1"
        finally:
            browser.close()
