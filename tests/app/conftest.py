"""The apps' tests share the bundled model (the one `mmpipe caption`, the demo and the server
load by default), one Pipeline per test module."""

from __future__ import annotations

import pytest

from mmpipe import Pipeline


@pytest.fixture(scope="module")
def pipe():
    with Pipeline.from_pretrained(device="cpu") as pipeline:
        yield pipeline
