"""The page in a real browser (Debian chromium driven by Playwright): pick a preset and see its bars at once, edit
the evidence and run it live, see refusals and the fabricated-numbers notice in the page. Saves a screenshot."""

from __future__ import annotations

import os
import re
import shutil

import pytest
from conftest import serving

import blink

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
ARTIFACTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "artifacts")
NEWS = "News topic (30 categories)"

pytestmark = pytest.mark.skipif(not shutil.which(CHROMIUM), reason="needs Debian chromium (bash tools/setup.sh --browser)")


@pytest.fixture(scope="module")
def page(launched):
    """A chromium page open on the launched app."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        tab = browser.new_page(viewport={"width": 1400, "height": 1600})
        tab.set_default_timeout(30_000)
        tab.goto(launched[1])
        yield tab
        browser.close()


def pick_preset(page, name: str) -> None:
    """Choose a preset in the dropdown."""
    page.locator("#preset input").click()
    page.get_by_role("option", name=name, exact=True).click()


def test_opens_on_a_recorded_preset(page):
    from playwright.sync_api import expect

    expect(page.locator("#meta .bk-replay")).to_contain_text("served from the recording")
    expect(page.locator("#answers .bk-card").first).to_be_visible()


def test_preset_renders_from_the_recording_then_edit_runs_live(page):
    from playwright.sync_api import expect

    pick_preset(page, NEWS)
    card = page.locator('#answers .bk-card[data-question="topic"]')
    expect(card.locator(".bk-row")).to_have_count(30)  # every option has its bar, no top-k cut
    expect(card.locator(".bk-chosen")).to_have_count(1)
    expect(page.locator("#meta .bk-replay")).to_contain_text("no model call")
    assert page.locator("#evidence textarea").input_value().startswith("Grid operators in Texas")

    page.locator("#evidence textarea").fill("The city council voted 7-2 on Monday to approve a new stadium for "
                                            "the football club, funded partly by a hotel tax.")
    page.locator("#decide").click()
    expect(page.locator("#meta .bk-live")).to_contain_text("the model ran on this input", timeout=90_000)
    expect(page.locator("#meta .bk-meta")).to_contain_text(blink.MODEL_ID)
    expect(card.locator(".bk-row")).to_have_count(30)
    widths = card.locator(".bk-fill").evaluate_all("els => els.map(e => parseFloat(e.style.width))")
    assert max(widths) == pytest.approx(100.0) and all(0 <= w <= 100 for w in widths)
    os.makedirs(ARTIFACTS, exist_ok=True)
    page.screenshot(path=os.path.join(ARTIFACTS, "browser.png"), full_page=True)


def test_score_and_noul_cards(page):
    from playwright.sync_api import expect

    pick_preset(page, "Support ticket triage")
    expect(page.locator('#answers .bk-card[data-question="urgency"] .bk-scale-marker')).to_be_visible()
    expect(page.locator('#answers .bk-card[data-question="urgency"]')).to_contain_text("can wait a week")
    meter = page.locator('#answers .bk-card[data-question="escalate"] [role="meter"]')
    expect(meter).to_have_attribute("aria-valuenow", re.compile(r"^0\.\d{4}$|^1\.0000$"))


def test_refusals_and_fabricated_numbers_show_in_the_page(page):
    from playwright.sync_api import expect

    page.locator("#evidence textarea").fill("   ")
    page.locator("#decide").click()
    expect(page.locator("#meta .bk-error")).to_contain_text("state is empty")
    expect(page.locator("#meta .bk-error")).to_contain_text("(field: state)")

    page.locator("#evidence textarea").fill("Two charges of $480 appeared on the March invoice.")
    with serving(blink.MockEngine(blink.MODEL_ID)):
        page.locator("#decide").click()
        expect(page.locator("#meta .bk-fabricated")).to_contain_text("fabricated")
    expect(page.locator("#meta .bk-fabricated")).to_be_visible()
