"""Reading a daemon's Prometheus endpoint in tests.

``scrape(port)`` -> ``{'name{label="value",...}': value}`` for every ``cuinterpose_*`` sample
(without the ``*_created`` timestamps), parsed with prometheus_client's text parser; the key is
the sample as the exposition writes it (labels in their order), so tests compare exact
samples. ``text(port)`` is the raw exposition."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def text(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def scrape(port: int) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text(port)):
        for s in fam.samples:
            if not s.name.startswith("cuinterpose_") or s.name.endswith("_created"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items())
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out
