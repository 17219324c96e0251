"""Write the bundled image example: a generated bar chart (PNG data URI in the state) with questions about it.

    python tools/image_example.py            # writes examples/support-chart-image.json

The chart is drawn here with PIL, so the example is reproducible and carries no third-party picture. Only a vision
model can answer it (BLINK_VISION or BLINK_VISION_TOWER); a text-only model answers "this model reads text only".
"""

from __future__ import annotations

import base64
import io
import json
import os

from PIL import Image, ImageDraw

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(HERE, "examples", "support-chart-image.json")
TICKETS = {"Q1": 310, "Q2": 420, "Q3": 585, "Q4": 265}  # made-up figures for a made-up help desk


def chart_png(tickets: dict[str, int], width: int = 384, height: int = 256) -> bytes:
    """A plain bar chart of tickets per quarter as PNG bytes."""
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    draw.text((12, 8), "Support tickets per quarter", fill="black")
    base, top, left = height - 32, 40, 40
    draw.line((left, top, left, base), fill="black")
    draw.line((left, base, width - 12, base), fill="black")
    slot = (width - left - 24) // len(tickets)
    peak = max(tickets.values())
    for i, (quarter, count) in enumerate(tickets.items()):
        x0 = left + 12 + i * slot
        y0 = base - round((base - top) * count / peak)
        draw.rectangle((x0, y0, x0 + slot - 24, base - 1), fill=(40, 110, 200))
        draw.text((x0 + 4, y0 - 14), str(count), fill="black")
        draw.text((x0 + 8, base + 8), quarter, fill="black")
    buf = io.BytesIO()
    img.save(buf, "PNG", optimize=True)
    return buf.getvalue()


def example() -> dict:
    """The example request: the chart inline in the state, three typed questions about it."""
    uri = "data:image/png;base64," + base64.b64encode(chart_png(TICKETS)).decode("ascii")
    return {
        "name": "Chart from a support review (image)",
        "description": "A bar chart inside the evidence as a PNG data URI. Needs a vision model.",
        "state": {"document": "Quarterly support review, slide 3", "chart": uri},
        "questions": {
            "busiest": {
                "type": "choice",
                "instructions": "Which quarter had the most support tickets?",
                "criteria": ["Q1", "Q2", "Q3", "Q4"],
            },
            "rising": {"type": "noul", "instructions": "Do tickets rise every quarter from Q1 to Q3?"},
            "legibility": {
                "type": "score",
                "instructions": "How easy is the chart to read?",
                "criteria": ["hard to read", "readable with effort", "clear at a glance"],
            },
        },
    }


if __name__ == "__main__":
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as fh:
        json.dump(example(), fh, ensure_ascii=False, indent=1)
        fh.write("\n")
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes)")
