"""The HTML report in a real browser: playwright drives Debian's chromium (never a browser that
playwright downloads), and every number the page computes is compared with the CLI's own.

One browser and one short real run (trained through the CLI, so its report.html is the one
`zerojax train` writes) serve the whole module. Skipped, with the reason, where chromium or
playwright is missing; `.ci/run` installs chromium, the test extra installs playwright.
"""

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest

from conftest import TINY
from zerojax import cli, formats

CHROMIUM = os.environ.get("ZEROJAX_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).is_file():
    pytest.skip(f"no chromium at {CHROMIUM}: apt-get install chromium (.ci/run does)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install -e '.[test]'")
# What works as root on this machine type, with no network and no GPU.
LAUNCH = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
          "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# The three, its edges (FP16's largest and its overflow threshold, E4M3's largest and
# the tie above it, E5M2's largest), and more: subnormals of every format and ties below them,
# ties between neighbours, numbers just past a threshold, the double-rounding probes of
# formats.rounds_via_float32 (1 + 2^-(m+1) + 2^-30), signed zeros, infinities and NaN.
VALUES = [
    "0.1", "70000", "0.000001", "65504", "65520", "448", "464", "57344",
    "465", "480", "61440", "65519.99", "57343", "3.14159", "1.0001", "1", "-2.5", "0", "-0", "100",
    "1e-40", "1.401298464324817e-45", "7e-46", "6e-08", "2.98023223876953125e-08", "0.001953125",
    "0.0029296875", "1.52587890625e-05", "1e-5", "-1e-10", "0.0001",
    repr(1 + 2**-8 + 2**-30), repr(1 + 2**-4 + 2**-30), repr(1 + 2**-3 + 2**-30), repr(1 + 2**-11 + 2**-30),
    "3.4028235e38", "3.5e38", "1e39", "1e30", "-70000", "123456789", "1e16", "1_000.5",
    "inf", "-inf", "nan", "-nan", "1e400", "1e-400",
]
EXAMPLES = ["0.1", "70000", "0.000001", "3.14159", "65504", "448", "1.0001"]

ROWS = """() => [...document.querySelectorAll('[data-format]')].map(row => ({
  format: row.dataset.format,
  bits: [...row.querySelectorAll('.field')].map(f => f.textContent).join(' '),
  stored: row.querySelector('.stored').textContent,
  rel_error: row.querySelector('.rel-error').dataset.value,
  status: row.querySelector('.status').textContent,
  cells: [...row.querySelectorAll('.bit')].map(b => b.className + ':' + b.textContent),
}))"""
BARS = """() => [0, 1, 2, 3].map(s => {
  const bar = document.querySelector(`[data-stage="${s}"]`);
  return {text: bar.textContent, bytes: bar.dataset.bytes, gb: bar.dataset.gb};
})"""


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=LAUNCH)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two short real runs through the CLI: stage 3 with evals, with the report.html `zerojax
    train` writes; and stage 1 in fp16 with train.report=false, whose loss scale starts too high
    (2^20, no hysteresis): its first two steps overflow and are skipped (tests/test_precision.py
    checks the scaler itself). The first run's step is the program `zerojax report` compiles for
    its stage 3: the compilation cache has it (conftest.CACHE)."""
    root = tmp_path_factory.mktemp("runs")
    fp16 = ["zero.stage=1", "precision.compute=float16", "precision.initial_scale_power=20", "precision.hysteresis=1",
            "train.report=false"]
    for name, extra in (("stage3", ["train.eval_every=3"]), ("fp16-stage1", fp16)):
        assert cli.main(["train", "--no-progress", *TINY, "train.global_batch=16", *extra,
                         f"train.out_dir={root / name}"]) == 0
    return root / "stage3", root / "fp16-stage1"


@pytest.fixture(scope="module")
def report(runs, tmp_path_factory):
    """`zerojax report stage3 fp16-stage1`: stage3's stages compiled now (its analyze.json kept),
    fp16-stage1 left without (--no-analyze), and the curves of both."""
    out = tmp_path_factory.mktemp("report") / "report.html"
    assert cli.main(["report", str(runs[0]), "--out", str(out)]) == 0  # computes stage3/analyze.json
    assert cli.main(["report", str(runs[0]), str(runs[1]), "--no-analyze", "--out", str(out)]) == 0
    return out


class Page:
    """A page opened from disk, with what it said on the console and every request it made."""

    def __init__(self, browser, path: Path):
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.errors, self.requests = [], []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(path.as_uri())

    def check_quiet(self):
        assert self.errors == []  # no console errors
        assert all(url.startswith(("file:", "data:")) for url in self.requests), self.requests  # no network


@pytest.fixture
def page(browser, report):
    opened = Page(browser, report)
    yield opened
    opened.page.close()


def formats_json(capsys, values) -> dict:
    """`zerojax formats VALUE ... --json`, once for all values, as {input: {format: cell}}."""
    assert cli.main(["formats", "--json", "--", *values]) == 0
    return {v["input"]: v["formats"] for v in json.loads(capsys.readouterr().out)["values"]}


def expected_rows(cells: dict) -> list[dict]:
    """What the page must show for one value: the JSON's stored text (json.dumps writes repr)."""
    return [{"format": name, "bits": c["bits"], "stored": c["stored"] if isinstance(c["stored"], str) else repr(c["stored"]),
             "rel_error": "null" if c["rel_error"] is None else repr(c["rel_error"]), "status": c["status"]}
            for name, c in cells.items()]


def shown_rows(page) -> list[dict]:
    rows = page.evaluate(ROWS)
    for row in rows:  # the cells: sign, exponent, mantissa in that order, filled exactly where a 1 is
        fields = [c.split(":")[0].split()[1] for c in row["cells"]]
        assert fields == sorted(fields, key=["sign", "exponent", "mantissa"].index) and fields[0] == "sign"
        assert all(("one" in c.split(":")[0].split()) == (c.endswith(":1")) for c in row.pop("cells"))
    return rows


def test_explorer_stores_every_value_as_zerojax_formats_does(page, capsys):
    reference = formats_json(capsys, VALUES)
    assert len(VALUES) >= 33 and [r["format"] for r in shown_rows(page.page)] == list(formats.FORMATS)
    for value in VALUES:
        page.page.fill("#value", value)
        assert shown_rows(page.page) == expected_rows(reference[value]), value
    page.check_quiet()


def test_every_examples_button(page, capsys):
    buttons = page.page.locator("#examples button")
    assert buttons.all_text_contents() == EXAMPLES
    reference = formats_json(capsys, EXAMPLES)
    page.page.fill("#value", "12345")
    for k, value in enumerate(EXAMPLES):
        buttons.nth(k).click()
        assert page.page.input_value("#value") == value
        assert shown_rows(page.page) == expected_rows(reference[value]), value
    page.check_quiet()


def test_a_value_that_is_not_a_number_says_so(page):
    page.page.fill("#value", "abc")
    with pytest.raises(ValueError) as err:
        formats.parse_value("abc")
    assert page.page.text_content("#value-error") == str(err.value)
    assert all(r["stored"] == "" and r["status"] == "" for r in page.page.evaluate(ROWS))
    page.page.fill("#value", "0.1")
    assert page.page.text_content("#value-error") == ""
    page.check_quiet()


@pytest.mark.parametrize("psi, devices, k", [("1.3e9", "1", "12"), ("124M", "8", "12"), ("70e9", "512", "16"),
                                              ("3B", "7", "0"), ("8030261248", "64", "12.5")])
def test_memory_bars_are_zerojax_memory(page, capsys, psi, devices, k):
    page.page.fill("#psi", psi)
    page.page.fill("#devices", devices)
    page.page.fill("#k", k)
    assert cli.main(["memory", "--params", psi, "--devices", devices, "--k", k, "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    for stage, bar in enumerate(page.page.evaluate(BARS)):
        nbytes = stages[str(stage)]
        assert bar["bytes"] == repr(float(nbytes))  # the same double as Python's formula
        shown = float(bar["text"].removesuffix(" GB"))  # 3 significant digits, always in GB
        assert shown == pytest.approx(nbytes / 1e9, rel=5e-3), (stage, bar)
    page.check_quiet()


def test_the_papers_preset(page):
    page.page.fill("#psi", "1")
    page.page.click("#preset")
    assert [page.page.input_value(i) for i in ("#psi", "#devices", "#k")] == ["7.5B", "64", "12"]
    assert [b["text"] for b in page.page.evaluate(BARS)] == ["120 GB", "31.4 GB", "16.6 GB", "1.88 GB"]
    page.page.fill("#devices", "0")
    assert "N: give a whole number" in page.page.text_content("#memory-error")
    page.check_quiet()


def svg_points(page, selector: str) -> list[tuple[float, float]]:
    """The vertices of the path of a matplotlib line, from its SVG `d` attribute."""
    d = page.get_attribute(f"{selector} path", "d")
    return [(float(x), float(y)) for x, y in re.findall(r"[ML]\s*(-?[\d.]+)\s+(-?[\d.]+)", d)]


def test_the_runs_curves_overlaid(page, runs):
    lines = [[json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] for run in runs]
    assert [r.split()[0] for r in page.page.locator("table.runs tbody tr").all_inner_texts()] == ["stage3", "fp16-stage1"]
    for i, logged in enumerate(lines):
        for key in ("loss", "lr", "grad_norm", "loss_scale", "tokens_per_sec"):
            finite = [x[key] for x in logged if x[key] is not None and math.isfinite(x[key])]  # a skipped step: null
            assert len(svg_points(page.page, f'figure[data-plot="{key}"] g[id="{key}-{i}"]')) == len(finite), (key, i)
    evals = [x for x in lines[0] if "eval_loss" in x]
    assert len(evals) == 2 and page.page.locator('g[id="eval_loss-0"] use').count() == 2  # two markers
    skipped = [x["step"] for x in lines[1] if x["skipped"]]
    assert skipped == [1, 2] and page.page.locator('g[id="skipped-1"] use').count() == 2  # two red crosses
    assert page.page.locator('g[id="skipped-0"]').count() == 0
    legend = page.page.locator('figure[data-plot="loss"] svg').text_content()
    assert "stage3" in legend and "fp16-stage1" in legend and "eval loss" in legend
    assert "skipped step (2 among the logged)" in page.page.locator('figure[data-plot="loss_scale"] svg').text_content()
    # the loss panel draws what metrics.jsonl says: its y pixels are an affine image of the losses
    (x0, y0), (x1, y1) = svg_points(page.page, 'g[id="loss-0"]')[:2]
    losses = [x["loss"] for x in lines[0]]
    for (_, y), loss in zip(svg_points(page.page, 'g[id="loss-0"]'), losses):
        assert y == pytest.approx(y0 + (y1 - y0) * (loss - losses[0]) / (losses[1] - losses[0]), abs=0.02)
    page.check_quiet()


def test_measured_stages_next_to_the_formula(page, runs):
    doc = json.loads((runs[0] / "analyze.json").read_text())
    assert set(doc["stages"]) == {"0", "1", "2", "3"} and not (runs[1] / "analyze.json").exists()
    assert page.page.locator("figure.measured").count() == 1  # stage1 has no analyze.json: a note instead
    assert "no analyze.json" in page.page.text_content("#memory")

    def height(gid):
        ys = [y for _, y in svg_points(page.page, f'g[id="{gid}"]')]
        return max(ys) - min(ys)

    for stage, m in doc["stages"].items():  # bar heights in proportion to the bytes
        for measured, formula in (("argument_bytes", "formula_bytes"), ("comm_bytes", "comm_theory_bytes")):
            ratio = height(f"analyze-0-{measured}-{stage}") / height(f"analyze-0-{formula}-{stage}")
            assert ratio == pytest.approx(m[measured] / m[formula], rel=1e-3), (stage, measured)
        assert page.page.locator(f'g[id="analyze-0-temp_bytes-{stage}"]').count() == 1
    page.check_quiet()


def test_the_report_train_wrote(browser, runs):
    assert not (runs[1] / "report.html").exists()  # train.report=false
    html = (runs[0] / "report.html").read_text()
    assert len(html.encode()) < 1_000_000
    opened = Page(browser, runs[0] / "report.html")
    assert opened.page.locator('g[id="loss-0"]').count() == 1 and opened.page.locator('g[id="loss-1"]').count() == 0
    assert opened.page.locator("figure.measured").count() == 0  # train does not compile the other stages
    opened.check_quiet()
    opened.page.close()


def test_screenshot(page, tmp_path_factory):
    """The explorer showing 0.1, at 1280x900: a test artifact (ZEROJAX_REPORT_SCREENSHOT names where)."""
    page.page.fill("#value", "0.1")
    out = Path(os.environ.get("ZEROJAX_REPORT_SCREENSHOT") or tmp_path_factory.mktemp("artifacts") / "report.png")
    page.page.screenshot(path=str(out))
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and (int.from_bytes(png[16:20]), int.from_bytes(png[20:24])) == (1280, 900)
    print(f"screenshot: {out}")
    page.check_quiet()
