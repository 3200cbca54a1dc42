"""Tests marked `container_image` run after every other test: scripts/test.sh builds the image in the
background meanwhile, so a cold build overlaps the rest of the suite instead of adding to it."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("container_image") is not None)
