"""The live page of dlm-serve in a real headless browser (Debian's chromium + chromedriver, driven by selenium;
`.ci/run` installs them): type a prompt, pick a strategy, decode, and the page shows the API's text and steps."""
import os
import shutil

import pytest

from conftest import need

need("starlette", "serve")
httpx = need("httpx", "dev")
webdriver = need("selenium.webdriver", "dev")

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and DRIVER):
        if os.environ.get("DLM_ENGINE_TEST_ALL") == "1":
            pytest.fail("chromium and chromedriver are not installed (apt-get install chromium chromium-driver)")
        pytest.skip("chromium and chromedriver are not installed (apt-get install chromium chromium-driver)")
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"          # selenium never downloads a browser or a driver
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        opts.add_argument(a)
    drv = webdriver.Chrome(service=Service(executable_path=DRIVER), options=opts)
    yield drv
    drv.quit()


def test_the_page_denoises_a_prompt_and_agrees_with_the_api(browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from dlm_engine.serve.cli import ServerThread

    with ServerThread(["device=cpu"], tmp_path) as s:
        api = httpx.post(s.url + "/v1/completions", json={
            "prompt": "901-256=", "max_tokens": 16,
            "dlm": {"strategy": "threshold", "threshold": 0.8, "block_length": 8}}, timeout=60).json()["choices"][0]
        browser.get(s.url + "/")
        wait = WebDriverWait(browser, 60)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#strategy option")) > 3)
        box = browser.find_element(By.ID, "prompt")
        box.clear()
        box.send_keys("901-256=")
        Select(browser.find_element(By.ID, "strategy")).select_by_value("threshold")
        browser.find_element(By.ID, "options").send_keys('{"threshold": 0.8, "block_length": 8}')
        browser.find_element(By.ID, "go").click()
        wait.until(lambda d: d.find_element(By.ID, "status").text in ("done", "error"))
        assert browser.find_element(By.ID, "error").text == ""
        assert browser.find_element(By.ID, "text").text == api["text"]
        assert int(browser.find_element(By.ID, "steps").text) == api["dlm"]["steps"]
        assert int(browser.find_element(By.ID, "nfe").text) == api["dlm"]["nfe"]
        cells = browser.find_elements(By.CSS_SELECTOR, "#canvas .cell")
        assert len(cells) == 16 and not [c for c in cells if "masked" in c.get_attribute("class").split()]
        colours = {c.value_of_css_property("background-color") for c in cells}
        assert len(colours) == len({x for x in api["dlm"]["commit_step"]})   # one colour per commit step
