"""The presets' recording: `python blink.py record` runs the live model over every bundled text example and writes
the label logits the replay engine serves (blink.Recording reads them), with the model, hardware and time that made
them."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import blink


def recording_entry(readouts: dict[str, blink.Readout]) -> dict:
    """The "logits" and "lse" of a recording entry; a one-prompt question keeps the original flat layout."""
    return {
        "logits": {qkey: r.logits[0] if len(r.logits) == 1 else r.logits for qkey, r in readouts.items()},
        "lse": {qkey: r.lse for qkey, r in readouts.items()},
    }


def record(model_id: str | None = None, path: str | None = None, settings: blink.Settings | None = None) -> dict:
    """Run the live model over every bundled text example and write the recording the replay engine serves.
    Examples with images are skipped: decide() always answers an image request with the live model."""
    settings = settings or blink.env_settings()
    model_id = model_id or settings.default_model
    live = blink.TorchEngine(model_id, settings.revision(model_id), settings)
    requests = {}
    for file in blink.example_files():
        example = blink.load_example(file)
        request = blink.parse_request(
            example["state"], example["questions"], images=example.get("images"), settings=settings
        )
        if request.holds_images():
            continue
        t0 = time.perf_counter()
        result = live.forward(request)
        requests[request.key] = {
            "example": os.path.basename(file),
            **recording_entry(result.readouts),
            "input_tokens": result.input_tokens,
            "latency_ms": blink.since_ms(t0),
            "model_ms": result.model_ms,
        }
    data = {
        "model": model_id,
        "revision": live.revision,
        "hardware": blink.hardware(),
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "requests": requests,
    }
    with open(path or settings.replay_path_for(model_id), "w", encoding="utf-8") as fh:
        json.dump(data, fh, ensure_ascii=False, indent=1)
        fh.write("\n")
    return data


def main(argv: list[str] | None = None) -> int:
    """`python blink.py record [--model ID] [--out FILE]`: one line saying what was recorded; 2 when refused."""
    parser = argparse.ArgumentParser(prog="blink.py record", description="record the bundled examples' answers")
    parser.add_argument("--model", default=None, help="one of the served models (BLINK_MODELS)")
    parser.add_argument("--out", default=None, help="where to write the recording (default: the model's replay file)")
    args = parser.parse_args(argv)
    try:
        data = record(args.model, args.out)
    except blink.BlinkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"recorded {len(data['requests'])} examples with {data['model']} on {data['hardware']}")
    return 0
