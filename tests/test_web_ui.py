"""The chat page at `qwen3vl serve`'s root (runtime/serve/webui.py, runtime/serve/web/), in a
real browser: Debian's chromium driven through chromium-driver by selenium, against the real
server process over the tiny checkpoint (tests/serve_helpers.py; it has an API key, so the
page asks for it). The random weights answer noise, so each answer is forced through the
page's "Extra request fields" setting (`guided_choice` with one choice: the exact text), and
what is checked is what the page does with it: streamed, kept in IndexedDB across a reload,
grounding drawn where the 0-1000 frame says, a <script> shown and never run. One server and
one browser for the module. Screenshots go to $QWEN3VL_SCREENSHOTS (else the test's tmp dir).
Skipped when chromium, chromium-driver or selenium is missing (`.ci/run` installs them)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from PIL import Image

pytest.importorskip("openai")
pytest.importorskip("httpx2")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra pins it)")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if not (CHROMIUM and DRIVER):
    pytest.skip("no chromium and chromium-driver found (apt-get install chromium chromium-driver; .ci/run does)",
                allow_module_level=True)

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from serve_helpers import KEY, Server, httpx, module_server  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "assets" / "demo.png"  # 320 x 224: not square, so x and y scale differently
WEB = ROOT / "runtime" / "serve" / "web"
DESCRIBED = "The picture shows **three shapes** on a plain background."
GROUNDED = ('Found them:\n```json\n[\n {"bbox_2d": [100, 250, 600, 750], "label": "left shape"},\n'
            ' {"point_2d": [800, 200], "label": "dot"}\n]\n```')
SCRIPTED = ('Careful: <script>window.injected = 1</script> and <img src=x onerror="window.injected = 2"> '
            'are shown, **not run**.')


@pytest.fixture(scope="module")
def server(tmp_path_factory, serve_cache):
    yield from module_server(tmp_path_factory.mktemp("web-ui"), serve_cache)


@pytest.fixture(scope="module")
def downloads(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("downloads")


@pytest.fixture(scope="module")
def browser(downloads):
    options = webdriver.ChromeOptions()
    options.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                              "download.prompt_for_download": False})
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1200,860", "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("QWEN3VL_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def wait(driver, condition, timeout=60):
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d))


def css(driver, selector):
    return driver.find_elements(By.CSS_SELECTOR, selector)


def ready(driver) -> bool:
    return driver.execute_script("return document.body.dataset.ready === 'true'")


def test_the_page_is_served_as_the_api_is(server):
    """`/` and the page's files are public and carry the CSP; the API behind them still needs
    the key; the Host check applies to the page too; nothing is loaded from elsewhere."""
    assert f"ready at {server.url}/v1 (chat page: {server.url}/)" in server.output()
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html"), page.text[:200]
    csp = page.headers["content-security-policy"]
    assert "script-src 'self';" in csp and "unsafe" not in csp and "http" not in csp, csp
    assert page.headers["x-content-type-options"] == "nosniff"
    for name in ("app.js", "api.js", "settings.js", "markdown.js", "grounding.js", "store.js", "style.css"):
        r = httpx.get(f"{server.url}/web/{name}")
        assert r.status_code == 200 and r.headers["content-security-policy"] == csp, name
    missing = httpx.get(server.url + "/web/secret.py")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert httpx.get(server.url + "/", headers={"Host": "evil.example"}).status_code == 421
    assert httpx.get(server.url + "/v1/models").status_code == 401
    html = (WEB / "index.html").read_text()
    assert re.findall(r'(?:src|href)="([^"]*)"', html) == ["/web/style.css", "/web/app.js"]
    assert not re.search(r"<script(?![^>]*\bsrc=)|\son\w+=|\sstyle=", html)  # no inline script, handler, style
    for js in WEB.glob("*.js"):
        assert all(m.startswith("./") for m in re.findall(r'from "([^"]+)"', js.read_text())), js


def test_the_key_is_asked_for_once(server, browser, shots):
    """The server has a key: the page asks for it, says so when a wrong one is refused, and
    keeps the right one in the tab (asked again only in a new tab: sessionStorage)."""
    browser.get(server.url + "/")
    wait(browser, lambda d: d.execute_script("return document.getElementById('key-dialog').open"))
    for key in ("wrong", KEY):
        browser.find_element(By.ID, "key").send_keys(key)
        browser.find_element(By.ID, "key-submit").click()
        if key == "wrong":
            wait(browser, lambda d: d.find_element(By.ID, "key-error").text == "The server refused that key.")
            browser.save_screenshot(str(shots / "key.png"))
    wait(browser, ready)
    assert not browser.execute_script("return document.getElementById('key-dialog').open")
    assert browser.find_element(By.ID, "model").text == "model"
    assert browser.execute_script("return sessionStorage.getItem('qwen3vl-api-key')") == KEY
    browser.find_element(By.ID, "settings-toggle").click()
    browser.save_screenshot(str(shots / "settings.png"))
    browser.find_element(By.ID, "settings-toggle").click()


def force(driver, text: str | None, **more) -> None:
    """The next answers forced to `text` (the page's "Extra request fields" setting)."""
    fields = dict({"guided_choice": [text]} if text is not None else {}, **more)
    if not driver.find_element(By.ID, "settings").is_displayed():
        driver.find_element(By.ID, "settings-toggle").click()
    box = driver.find_element(By.ID, "extra")
    box.clear()
    box.send_keys(json.dumps(fields))
    driver.find_element(By.ID, "settings-toggle").click()


def ask(driver, prompt: str, image: Path | None = None):
    """Send `prompt` (with `image` attached through the file input); the answer's element
    once it is done."""
    if image is not None:
        driver.find_element(By.ID, "file").send_keys(str(image))
        wait(driver, lambda d: css(d, "#attachments .attachment img"))
    before = len(css(driver, ".msg.assistant"))
    driver.find_element(By.ID, "prompt").send_keys(prompt)
    driver.find_element(By.ID, "send").click()
    wait(driver, lambda d: len(css(d, ".msg.assistant")) > before and
         css(d, ".msg.assistant")[-1].get_attribute("data-state") in ("done", "error", "stopped"))
    answer = css(driver, ".msg.assistant")[-1]
    assert answer.get_attribute("data-state") == "done", answer.text
    return answer


def test_an_image_asked_about_streams_its_answer(server, browser, shots):
    force(browser, DESCRIBED)
    misses = server.metric("qwen3vl_encoder_cache_misses_total")
    answer = ask(browser, "What is in this image?", DEMO)
    assert answer.find_element(By.CSS_SELECTOR, ".markdown").text == DESCRIBED.replace("**", "")
    assert answer.find_element(By.CSS_SELECTOR, ".markdown strong").text == "three shapes"
    assert int(answer.get_attribute("data-chunks")) > 1  # it came in pieces, shown as they came
    assert server.metric("qwen3vl_encoder_cache_misses_total") == misses + 1  # the image reached the tower
    question = css(browser, ".msg.user")[-1]
    assert question.find_element(By.CSS_SELECTOR, ".media img").get_attribute("src").startswith("data:image/png")
    browser.save_screenshot(str(shots / "answer.png"))


def test_a_video_is_asked_about(server, browser, tmp_path):
    """A video attached through the same input goes as a video_url and reaches the tower."""
    from helpers import gradient_frames, write_video

    clip = write_video(tmp_path / "clip.mp4", gradient_frames(4, 64, 64, seed=2), rate=2)
    browser.find_element(By.ID, "new-chat").click()
    force(browser, "A short clip.")
    misses = server.metric("qwen3vl_encoder_cache_misses_total")
    browser.find_element(By.ID, "file").send_keys(clip)
    wait(browser, lambda d: css(d, "#attachments .attachment video"))
    answer = ask(browser, "What happens?")
    assert answer.find_element(By.CSS_SELECTOR, ".markdown").text == "A short clip."
    assert css(browser, ".msg.user .media video")[0].get_attribute("src").startswith("data:video/mp4")
    assert server.metric("qwen3vl_encoder_cache_misses_total") == misses + 1


def test_a_reload_finds_the_conversation(server, browser):
    browser.refresh()
    wait(browser, ready)
    assert not browser.execute_script("return document.getElementById('key-dialog').open")  # asked once per tab
    titles = [e.text for e in css(browser, "#conversations .open")]
    assert "What is in this image?" in titles, titles
    css(browser, "#conversations .open")[titles.index("What is in this image?")].click()
    wait(browser, lambda d: len(css(d, ".msg")) == 2)
    assert css(browser, ".msg.user .media img")
    assert css(browser, ".msg.assistant .markdown")[0].text == DESCRIBED.replace("**", "")


def test_grounding_is_drawn_where_the_frame_says(server, browser, shots):
    """A box [100, 250, 600, 750] and a point [800, 200] of the 0-1000 frame land at those
    fractions of the displayed image's width and height (320x224, shown scaled)."""
    browser.find_element(By.ID, "new-chat").click()
    force(browser, GROUNDED)
    browser.find_element(By.CSS_SELECTOR, "#examples button:nth-child(2)").click()  # "Locate"
    assert browser.find_element(By.ID, "prompt").get_attribute("value").startswith("Locate every object")
    answer = ask(browser, "", DEMO)
    wait(browser, lambda d: css(d, ".grounded img") and d.execute_script(
        "return document.querySelector('.grounded img').complete"))
    geometry = browser.execute_script("""
        const rect = (e) => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.width, r.height]; };
        const figure = document.querySelector('.msg.assistant:last-child .grounded');
        const img = figure.querySelector('img');
        return {img: rect(img), natural: [img.naturalWidth, img.naturalHeight],
                marks: [...figure.querySelectorAll('.gbox, .gpoint')].map(
                    (e) => [e.className, e.textContent, ...rect(e)])};""")
    left, top, width, height = geometry["img"]
    natural = list(Image.open(DEMO).size)
    assert geometry["natural"] == natural and abs(width / height - natural[0] / natural[1]) < 0.01, geometry
    assert abs(width - natural[0]) > 50, geometry  # shown at another size than its own: the marks scale with it
    (box, box_label, *box_rect), (point, point_label, *point_rect) = geometry["marks"]
    assert (box, box_label, point, point_label) == ("gbox", "left shape", "gpoint", "dot")
    expected = [left + 0.1 * width, top + 0.25 * height, 0.5 * width, 0.5 * height]
    assert all(abs(a - b) < 1.5 for a, b in zip(box_rect, expected)), (box_rect, expected)
    assert abs(point_rect[0] - (left + 0.8 * width)) < 1.5 and abs(point_rect[1] - (top + 0.2 * height)) < 1.5
    assert answer.find_element(By.CSS_SELECTOR, ".markdown pre code").text.startswith("[")
    browser.execute_script("arguments[0].scrollIntoView()", answer)
    browser.save_screenshot(str(shots / "grounding.png"))


def test_a_script_in_an_answer_is_shown_not_run(server, browser, shots):
    browser.find_element(By.ID, "new-chat").click()
    force(browser, SCRIPTED)
    answer = ask(browser, "Say something dangerous.")
    markdown = answer.find_element(By.CSS_SELECTOR, ".markdown")
    assert "<script>window.injected = 1</script>" in markdown.text and 'onerror="window.injected = 2"' in markdown.text
    assert markdown.find_element(By.CSS_SELECTOR, "strong").text == "not run"
    assert not markdown.find_elements(By.CSS_SELECTOR, "script, img")  # no element made from the answer's tags
    assert browser.execute_script("return window.injected") is None
    browser.save_screenshot(str(shots / "script.png"))


def test_reasoning_is_folded_away(server, browser):
    """An answer that thinks first: the reasoning in a closed <details>, the answer below."""
    browser.find_element(By.ID, "new-chat").click()
    force(browser, "<think>Count the shapes first.</think>Three shapes.")
    answer = ask(browser, "How many shapes?")
    details = answer.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert details.is_displayed() and details.get_attribute("open") is None
    assert details.find_element(By.CSS_SELECTOR, "summary").text == "Reasoning"
    assert answer.find_element(By.CSS_SELECTOR, ".markdown").text == "Three shapes."
    details.find_element(By.CSS_SELECTOR, "summary").click()
    assert details.find_element(By.CSS_SELECTOR, ".thoughts").text == "Count the shapes first."


def module_call(driver, module: str, function: str, *args):
    """`function(*args)` of one of the page's modules, run in the page."""
    return driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        f"import('/web/{module}').then((m) => done(m.{function}(...Array.from(arguments).slice(0, -1))),"
        " (e) => done({failed: String(e)}));", *args)


GROUNDING_FORMS = {  # answer text: the items read from it
    '{"bbox_2d": [1, 2, 3, 4], "label": "a"}': [("box", [1, 2, 3, 4], "a")],
    "[{'bbox_2d': [10, 20, 30, 40], 'label': 'quoted'},]": [("box", [10, 20, 30, 40], "quoted")],
    'Here: {"label": "say \\"hi\\"", "bbox_2d": [300, 400, 100, 200]} and {"point_2d": [5.5, 1200]}':
        [("box", [100, 200, 300, 400], 'say "hi"'), ("point", [5.5, 1000], "")],
    '```json\n[{"bbox_2d": [1, 1, 9, 9], "label": "x"}, {"bbox_2d": [2, 2, 8': [("box", [1, 1, 9, 9], "x")],
    '{bbox_2d: [0, 0, 1000, 1000], label: "bare keys"}': [("box", [0, 0, 1000, 1000], "bare keys")],
    '{"box": [1, 2, 3, 4]} {"bbox_2d": [1, 2]}': [],
}


def test_the_page_reads_grounding_and_markdown_leniently_and_safely(server, browser):
    """grounding.js on the shapes Qwen3-VL writes (fenced or not, lists or single objects,
    either quotes, trailing commas, cut off mid-list, coordinates swapped or past 1000), and
    markdown.js making only its own tags (no javascript: link, code left as text)."""
    if not browser.current_url.startswith(server.url):
        browser.get(server.url + "/")  # the modules are imported from the page's origin
    for text, expected in GROUNDING_FORMS.items():
        items = module_call(browser, "grounding.js", "parseGrounding", text)
        assert isinstance(items, list), items
        assert [(i["kind"], i["coords"], i["label"]) for i in items] == expected, text
    html = module_call(browser, "markdown.js", "renderMarkdown",
                       "# T\n- **a** `<b>`\n- [ok](https://x.test/a_b_c) [no](javascript:alert(1))\n\n"
                       "```\n<i>x</i>\n```")
    assert html == ('<h1>T</h1><ul><li><strong>a</strong> <code>&lt;b&gt;</code></li><li><a href="https://x.test/a_b_c" '
                    'target="_blank" rel="noopener noreferrer">ok</a> [no](javascript:alert(1))</li></ul>'
                    "<pre><code>&lt;i&gt;x&lt;/i&gt;</code></pre>"), html


def test_stop_regenerate_and_edit(server, browser):
    """Stop ends a long answer (the server frees its lane); Regenerate asks again; Edit puts
    the last question back in the composer, without its answer."""
    browser.find_element(By.ID, "new-chat").click()
    force(browser, None, ignore_eos=True)
    browser.find_element(By.ID, "prompt").send_keys("Go on forever.")
    browser.find_element(By.ID, "send").click()
    wait(browser, lambda d: css(d, ".msg.assistant") and int(css(d, ".msg.assistant")[-1].get_attribute("data-chunks")
                                                              or 0) > 2)
    browser.find_element(By.ID, "stop").click()
    wait(browser, lambda d: css(d, ".msg.assistant")[-1].get_attribute("data-state") == "stopped")
    wait(browser, lambda d: server.metric("qwen3vl_requests_running") == 0, 30)
    force(browser, "Again.")
    browser.find_element(By.CSS_SELECTOR, ".msg.assistant .regenerate").click()
    wait(browser, lambda d: css(d, ".msg.assistant")[-1].get_attribute("data-state") == "done")
    assert css(browser, ".msg.assistant .markdown")[-1].text == "Again."
    browser.find_element(By.CSS_SELECTOR, ".msg.user .edit").click()
    wait(browser, lambda d: not css(d, ".msg"))
    assert browser.find_element(By.ID, "prompt").get_attribute("value") == "Go on forever."


def test_paste_and_drop_attach_media(browser):
    """An image pasted and a video dropped (the events a browser fires, with files in their
    DataTransfer) become previews of the next message; × removes one."""
    browser.find_element(By.ID, "new-chat").click()
    browser.execute_script("""
        const png = Uint8Array.from(atob(arguments[0]), (c) => c.charCodeAt(0));
        const files = [new File([png], 'pasted.png', {type: 'image/png'}), new File(['x'], 'clip.mp4', {type: 'video/mp4'})];
        const paste = new DataTransfer(); paste.items.add(files[0]);
        document.getElementById('prompt').dispatchEvent(new ClipboardEvent('paste', {clipboardData: paste, bubbles: true}));
        const drop = new DataTransfer(); drop.items.add(files[1]);
        document.getElementById('messages').dispatchEvent(new DragEvent('drop', {dataTransfer: drop, bubbles: true}));
        """, base64.b64encode(DEMO.read_bytes()).decode())
    wait(browser, lambda d: len(css(d, "#attachments .attachment")) == 2)
    assert {e.tag_name for e in css(browser, "#attachments .attachment > :first-child")} == {"img", "video"}
    css(browser, "#attachments .remove")[0].click()
    wait(browser, lambda d: len(css(d, "#attachments .attachment")) == 1)
    css(browser, "#attachments .remove")[0].click()


def test_export_and_import(server, browser, downloads):
    """Export writes every conversation (images in them) as JSON; deleted, they come back
    from that file through Import."""
    titles = sorted(e.text for e in css(browser, "#conversations .open"))
    assert len(titles) >= 3, titles
    browser.find_element(By.ID, "export").click()
    wait(browser, lambda d: [p for p in downloads.glob("qwen3vl-chats-*.json")], 30)
    exported = next(downloads.glob("qwen3vl-chats-*.json"))
    data = json.loads(exported.read_text())
    assert data["format"] == "qwen3vl-chat" and sorted(c["title"] for c in data["conversations"]) == titles
    while css(browser, "#conversations .delete"):
        count = len(css(browser, "#conversations .delete"))
        css(browser, "#conversations .delete")[0].click()
        wait(browser, lambda d: len(css(d, "#conversations .delete")) == count - 1)
    browser.find_element(By.ID, "import-file").send_keys(str(exported))
    wait(browser, lambda d: len(css(d, "#conversations .open")) == len(titles))
    assert sorted(e.text for e in css(browser, "#conversations .open")) == titles
    bad = downloads / "bad.json"
    bad.write_text('{"conversations": [{"messages": [{"role": "robot", "content": "x"}]}]}')
    browser.find_element(By.ID, "import-file").send_keys(str(bad))
    wait(browser, lambda d: "expected {role: user|assistant" in d.find_element(By.ID, "messages").text)


def test_no_content_security_policy_was_broken(browser):
    """Nothing the page did (nor any answer) asked for what the CSP forbids."""
    errors = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not [m for m in errors if "Content Security Policy" in m], errors


def test_no_web_ui_turns_the_page_off(server, tmp_path):
    other = Server(tmp_path, server.model, server.cache, ["--no-web-ui"])
    try:
        for path in ("/", "/web/app.js"):
            r = httpx.get(other.url + path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (path, r.text)
        assert httpx.get(other.url + "/health").status_code == 200
        assert f"ready at {other.url}/v1\n" in other.output()  # no page named
    finally:
        other.process.kill()
        other.process.wait()
