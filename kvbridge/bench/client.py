"""A benchmark's client: one streamed OpenAI completion, timed as a user sees it."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

#: the words benchmark prompts are made of (English, one token each for most tokenizers)
WORDS = [
    "river",
    "stone",
    "bridge",
    "market",
    "garden",
    "winter",
    "harbour",
    "forest",
    "lantern",
    "village",
    "mountain",
    "orchard",
    "meadow",
    "castle",
    "island",
    "desert",
    "valley",
    "library",
    "kitchen",
    "window",
]


@dataclass(frozen=True)
class Streamed:
    """One streamed completion as the client saw it."""

    ttft_s: float
    tpot_s: float
    text: str


def stream_completion(url: str, body: dict[str, Any], timeout_s: float = 900) -> Streamed:
    """POST a streamed completion to `url`/v1/completions: TTFT (first token), TPOT
    (mean gap between the following ones) and the text. Raises with the server's
    answer when it is not a stream of tokens."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    parts: list[str] = []
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=timeout_s
    ) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"error in the stream: {event['error']}")
            if event.get("choices"):
                stamps.append(time.perf_counter())
                parts.append(event["choices"][0].get("text", ""))
    if not stamps:
        raise RuntimeError("no token streamed")
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
    return Streamed(stamps[0] - t0, tpot, "".join(parts))
