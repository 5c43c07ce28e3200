"""The compute map's HTML page in a real browser (by hand, not in CI: it needs Chromium, ``apt-get install -y
chromium``): ``python -m tests.render_compute_map [RELEASE] [--text TEXT] [--out DIR]``.

Writes the map of `TEXT` through `RELEASE` (default: a fresh ``small`` model saved to a temporary folder: untrained,
so its segments are noise, which is what a check of the drawing needs), renders ``DIR/map.html`` with headless
Chromium into ``DIR/screenshot.png``, and checks the screenshot: the text is there (dark glyph pixels on the
segment colours) and the page shows every colour of the palette (one per segment, cycling). A second rendering
hovers segment 3 by a dispatched mouse event and reads the tooltip back from the DOM
(``DIR/screenshot_hover.png``). Prints what it found and exits with 1 when a check fails.

It lives beside ``tests/reliability.py``, the other check run by hand: it uses the test helpers' conventions and is
no benchmark (``bench/`` feeds docs/results.md), and CI has no browser.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]
TEXT = (
    "The state of the union is strong. Our nation will continue to grow because people work hard, every day, in "
    "every town across this land. Ünïcödé too: naïve café, 日本語, and a spider 🕷️."
)
HOVER_SCRIPT = """<script>
const seg = document.querySelector('[data-i="3"]'), box = seg.getBoundingClientRect();
seg.dispatchEvent(new MouseEvent('mouseover', {bubbles: true}));
document.dispatchEvent(new MouseEvent('mousemove', {clientX: box.left, clientY: box.bottom}));
</script></body>"""


def chromium() -> str:
    """The Chromium executable. Raises ``FileNotFoundError`` with the install command when there is none."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    raise FileNotFoundError("no Chromium found: apt-get install -y chromium")


def run_chromium(page: Path, *args: str) -> str:
    """Run headless Chromium on `page` with `args` and a throwaway profile; returns its stdout."""
    with tempfile.TemporaryDirectory() as profile:
        command = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, page.resolve().as_uri()]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"chromium failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def screenshot(page: Path, out: Path) -> Path:
    run_chromium(page, f"--screenshot={out}", "--window-size=1200,800")
    if not out.is_file():
        raise RuntimeError(f"chromium wrote no screenshot to {out}")
    return out


def hex_rgb(colour: str) -> tuple[int, int, int]:
    return tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))


def check_screenshot(path: Path, palette: tuple[str, ...], segments: int) -> dict:
    """What the screenshot shows: pixels of each palette colour, dark (text) pixels, and whether the checks hold."""
    from PIL import Image

    with Image.open(path) as image:
        counts = {rgb: n for n, rgb in image.convert("RGB").getcolors(maxcolors=1 << 22)}
    by_colour = {colour: counts.get(hex_rgb(colour), 0) for colour in palette}
    dark = sum(n for rgb, n in counts.items() if max(rgb) < 90)
    shown = sum(1 for n in by_colour.values() if n > 200)
    return {
        "pixels_per_palette_colour": by_colour,
        "dark_text_pixels": dark,
        "distinct_colours": len(counts),
        "palette_colours_shown": shown,
        "ok": shown == min(len(palette), segments) and dark > 2000,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("release", nargs="?", help="a release folder (default: a fresh small model)")
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--out", type=Path, default=Path("compute_map_browser"))
    args = parser.parse_args(argv)
    from spider_training.commands.compute_map import PALETTE, compute_map, encode, load_release, write_map

    args.out.mkdir(parents=True, exist_ok=True)
    if args.release is None:
        from configuration_spider import SpiderConfig
        from modeling_spider import SpiderForConditionalGeneration

        model = SpiderForConditionalGeneration(SpiderConfig.from_preset("small")).eval()
    else:
        model = load_release(args.release)
    page, picture = write_map(model, args.text, args.out / "map")
    segments = int(compute_map(model, encode(args.text, model)).closed_segments[0]) + 1
    shot = check_screenshot(screenshot(page, args.out / "screenshot.png"), PALETTE, segments)
    print(
        f"{page} ({page.stat().st_size} bytes, {segments} segments with the null segment) -> "
        f"{args.out / 'screenshot.png'}"
    )
    print(f"screenshot: {shot}")

    hover = args.out / "map_hover.html"
    hover.write_text(page.read_text(encoding="utf-8").replace("</body>", HOVER_SCRIPT), encoding="utf-8")
    screenshot(hover, args.out / "screenshot_hover.png")
    tip = re.search(r'<div id="tip" style="([^"]*)">(.*?)</div>', run_chromium(hover, "--dump-dom"), re.S)
    hover_ok = bool(tip) and "display: block" in tip.group(1) and tip.group(2).startswith("segment 3")
    print(f"hover on segment 3: {tip.group(2) if tip else 'no tooltip in the DOM'!r}")
    ok = shot["ok"] and hover_ok
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
