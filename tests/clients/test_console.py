"""The web console (`/ui`) in a real browser: Debian's chromium, headless, driven by selenium
through Debian's chromedriver, against a real `prepos serve` on the bundled model with an API
key. Each view is checked from what the page shows, and saved as docs/figures/console-*.png.

On timing: the page polls the session list every 0.5 s and shows each event of a session's
stream as it arrives, so on a quiet machine a new session or a pushed answer shows well within
a second. This machine is shared and loaded, so the tests never assert how fast: each waits
for what the page must show (up to WAIT seconds) and asserts that it appeared.

The browser's console is read after every step (`goog:loggingPrefs`): no errors, but for the
refused requests of the refusal test (the browser logs each 401 it receives)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import httpx
import pytest

from prepos.paths import DEFAULT_MODEL
from tests.support.server_harness import ServerProc

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / "docs" / "figures"
KEY = "console-test-key"
WAIT = 60  # seconds: generous, for a loaded machine; nothing here times the page
SYSTEM = "Live price feed. Answer in one word."
Q = "Which way is ACME moving?"
DATA = ["ACME 41 43 44 47 48 50", "ACME 50 49 47 45 44 41"]
PATHS = ("fast", "fall-through", "cold")
TOOLS = [{"type": "function", "function": {"name": "get_price", "parameters": {
    "type": "object", "properties": {"ticker": {"type": "string"}}}}}]


def _webdriver():
    """selenium's webdriver, or a skip that says what is missing."""
    try:
        from selenium import webdriver
    except ImportError:
        pytest.skip("LOUD SKIP: selenium is not installed (pip install -e '.[test]'); the "
                    "console's browser tests did not run")
    missing = [b for b in ("chromium", "chromedriver") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"LOUD SKIP: {' and '.join(missing)} not found (apt-get install chromium "
                    "chromium-driver); the console's browser tests did not run")
    return webdriver


@pytest.fixture(scope="module")
def browser():
    webdriver = _webdriver()
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1360,900", "--hide-scrollbars"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server(browser, tmp_path_factory):  # the browser first: no server started to be skipped
    with ServerProc(DEFAULT_MODEL, tmp_path_factory.mktemp("srv-console"),
                    "--api-key", KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


# -- helpers ------------------------------------------------------------------------------
def wait(driver, what: str, cond):
    """What `cond(driver)` returns once it is truthy; fails naming `what` after WAIT s."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT, poll_frequency=0.05).until(
        cond, message=f"the console did not show {what} within {WAIT} s")


def find(driver, css: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, css)


def shown(driver, element_id: str) -> bool:
    found = find(driver, f"#{element_id}")
    return bool(found) and found[0].is_displayed()


def errors(driver) -> list[str]:
    """The console's error messages since the last call."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def type_into(driver, element_id: str, text: str, submit: bool = True) -> None:
    box = find(driver, f"#{element_id}")[0]
    box.clear()
    box.send_keys(text)
    if submit:
        box.submit()


def open_view(driver, server, view: str) -> None:
    """The console at `#view`, with the key in its session storage."""
    driver.get(server.url + "/ui/favicon.svg")  # the origin, without the page's script
    driver.execute_script("sessionStorage.setItem('prepos.key', arguments[0])", KEY)
    driver.get(f"{server.url}/ui#{view}")
    wait(driver, "the nav", lambda d: shown(d, "nav"))


def screenshot(driver, name: str) -> None:
    FIGURES.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(FIGURES / f"console-{name}.png"))


def create(client, **body) -> str:
    r = client.post("/sessions", json=body)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def settle(client, sid: str) -> dict:
    r = client.get(f"/sessions/{sid}", params={"wait_ready": 30})
    assert r.status_code == 200, r.text
    return r.json()


def label(element) -> str:
    return element.find_element("css selector", "[data-path]").get_attribute("data-path")


# -- the tests ----------------------------------------------------------------------------
def test_the_page_refuses_without_a_key_and_opens_with_one(browser, server):
    d = browser
    d.get(server.url + "/ui/favicon.svg")
    d.execute_script("sessionStorage.clear()")
    errors(d)
    d.get(server.url + "/ui")
    wait(d, "the key form", lambda d: shown(d, "key-form"))
    assert not shown(d, "nav") and not shown(d, "view-sessions")
    type_into(d, "key-input", "not-the-key")
    wait(d, "the refusal", lambda d: "Refused" in find(d, "#key-error")[0].text)
    assert "not valid" in find(d, "#key-error")[0].text
    assert not shown(d, "nav") and not shown(d, "view-sessions")
    assert d.execute_script("return sessionStorage.getItem('prepos.key')") is None
    refused = errors(d)  # the browser logs each 401 it got, and nothing else went wrong
    assert refused and all("401" in m for m in refused), refused
    screenshot(d, "key")
    type_into(d, "key-input", KEY)
    wait(d, "the sessions view", lambda d: shown(d, "view-sessions") and shown(d, "nav"))
    wait(d, "the model's name", lambda d: find(d, "#model-name")[0].text == DEFAULT_MODEL.name)
    assert errors(d) == []


def test_a_session_created_by_the_api_appears_live(browser, server, client):
    """The list polls: a session made through the API shows with its tier and ready state."""
    d = browser
    open_view(d, server, "sessions")
    wait(d, "the session count", lambda d: "sessions" in find(d, "#session-count")[0].text)
    sid = create(client, kind="streaming", system=SYSTEM, standing_queries=[Q])
    row = f'tr[data-sid="{sid}"]'
    wait(d, f"the new session {sid}", lambda d: find(d, row))
    client.post(f"/sessions/{sid}/append", json={"data": DATA[0]}).raise_for_status()
    settle(client, sid)
    wait(d, "its ready state", lambda d: find(d, row + ' [data-col="prepared"]')[0].text
         == "ready")
    assert find(d, row + ' [data-col="kv"]')[0].text in ("resident", "ram", "disk")
    agentic = create(client, kind="agentic", system="You are a helpful assistant.",
                     tools=TOOLS)
    wait(d, "the agentic session", lambda d: find(d, f'tr[data-sid="{agentic}"]'))
    type_into(d, "filter", sid, submit=False)  # the filter: only the matching session
    wait(d, "the filtered list", lambda d: len(find(d, "tbody tr")) == 1 and find(d, row))
    type_into(d, "filter", "", submit=False)
    find(d, "#kind-filter option[value='']")[0].click()
    wait(d, "both sessions", lambda d: len(find(d, "tbody tr")) >= 2)
    screenshot(d, "sessions")
    assert errors(d) == []


def test_the_session_view_shows_each_push_and_answers_a_question(browser, server, client):
    """The live view reads the event stream: an append made on the page is committed and its
    standing answer pushed, with its path; a question asked on the page is labelled."""
    d = browser
    sid = create(client, kind="streaming", system=SYSTEM, standing_queries=[Q])
    client.post(f"/sessions/{sid}/append", json={"data": DATA[0]}).raise_for_status()
    settle(client, sid)
    open_view(d, server, f"session/{sid}")
    wait(d, "the live stream", lambda d: find(d, "#s-live")[0].text == "live")
    wait(d, "the standing answer of version 1",
         lambda d: find(d, '#s-standing [data-version="1"]'))
    type_into(d, "append-input", DATA[1])  # on the page
    pushed = wait(d, "the standing answer pushed after the append",
                  lambda d: find(d, '#s-standing [data-version="2"]'))[0]
    assert label(pushed) == "fast"  # answered from its pre-positioned record
    assert "exact" in pushed.text
    info = client.get(f"/sessions/{sid}").json()
    assert info["version"] == 2 and info["messages"] == 3  # system, two data lines
    names = [e.get_attribute("data-event") for e in find(d, "#s-events li")]
    assert {"hello", "commit", "ready", "answer"} <= set(names), names
    type_into(d, "ask-tokens", "1", submit=False)
    type_into(d, "ask-input", Q)
    asked = wait(d, "the answer to the question", lambda d: find(d, "#s-answers .answer"))[0]
    assert label(asked) == "fast" and "exact" in asked.text  # the standing query's record
    type_into(d, "ask-input", "Is ACME up or down?")
    wait(d, "the ad-hoc answer", lambda d: len(find(d, "#s-answers .answer")) == 2)
    assert label(find(d, "#s-answers .answer")[0]) in PATHS
    wait(d, "the messages", lambda d: len(find(d, "#s-messages li")) == 3)
    screenshot(d, "session")
    assert errors(d) == []


def _assistant(d, n: int):
    """The n-th assistant answer of the chat, once it is there."""
    return wait(d, f"assistant answer {n}",
                lambda d: find(d, "#chat-log li.msg-assistant")[n - 1:])[0]


def test_the_chat_playground_labels_each_answer(browser, server, client):
    """A stateless conversation continues on its implicit session (its second turn a
    fall-through with cached tokens); a named session commits the turn; tools are sent."""
    d = browser
    named = create(client, kind="agentic", system=SYSTEM)
    open_view(d, server, "chat")
    wait(d, "the model", lambda d: find(d, f'#chat-model option[value="{DEFAULT_MODEL.name}"]'))
    wait(d, "the named session", lambda d: find(d, f'#chat-session option[value="{named}"]'))
    type_into(d, "chat-system", SYSTEM, submit=False)
    type_into(d, "chat-input", DATA[0])
    first = _assistant(d, 1)
    assert label(first) in PATHS and "first token" in first.text
    type_into(d, "chat-input", DATA[1])
    second = _assistant(d, 2)
    assert label(second) == "fall-through"  # the implicit session kept the first turn
    cached = int(re.search(r"(\d+) cached tokens", second.text).group(1))
    assert cached > 0, second.text
    screenshot(d, "chat")
    find(d, "#chat-clear")[0].click()
    wait(d, "a new conversation", lambda d: not find(d, "#chat-log li"))
    type_into(d, "chat-tools", json.dumps(TOOLS), submit=False)
    type_into(d, "chat-input", "What is the price of ACME?")
    assert label(_assistant(d, 1)) in PATHS
    type_into(d, "chat-tools", "", submit=False)
    find(d, f'#chat-session option[value="{named}"]')[0].click()
    wait(d, "the named session's conversation", lambda d: not find(d, "#chat-log li"))
    type_into(d, "chat-input", DATA[0])
    assert label(_assistant(d, 1)) in PATHS
    info = client.get(f"/sessions/{named}").json()
    assert info["messages"] == 3  # system, user, the answer: committed on the named session
    assert find(d, "#chat-error")[0].text == ""
    assert errors(d) == []


def test_the_metrics_view_draws_paths_latency_tiers_and_predecode(browser, server, client):
    d = browser
    sid = create(client, kind="streaming", system=SYSTEM, standing_queries=[Q])
    client.post(f"/sessions/{sid}/append", json={"data": DATA[0]}).raise_for_status()
    settle(client, sid)
    open_view(d, server, "metrics")
    wait(d, "the first sample", lambda d: find(d, "#m-facts div"))
    for _ in range(3):  # answers between two samples: bars of the paths over time
        r = client.post(f"/sessions/{sid}/query", json={"question": Q, "max_tokens": 1})
        assert r.status_code == 200 and r.headers["x-prepos-path"] == "fast", r.text
    wait(d, "the fast answers over time", lambda d: find(d, "#m-paths rect.s-fast[data-value]"))
    assert find(d, "#m-ttft rect.s-fast[data-value]")  # the latency histogram, by path
    assert find(d, "#m-ttft rect.s-cold[data-value]") or find(
        d, "#m-ttft rect.s-fall-through[data-value]")
    assert find(d, "#m-tiers rect.s-resident[data-value]")  # sessions resident
    labels = [t.text for t in find(d, "#m-predecode text")]
    assert {"decoded", "served", "wasted"} <= set(labels), labels
    assert not find(d, "#metrics-error")[0].text
    screenshot(d, "metrics")
    assert errors(d) == []
