"""Shared test fixtures and markers.

* Tests marked ``@pytest.mark.netns`` build an emulated network and need root and iproute2; they
  are skipped, with the reason, wherever :func:`interlace.testing.netns_available` says no.
* Multi-rank tests go through :func:`interlace.testing.run_ranks` (spawned gloo ranks with a hard
  timeout and the failing rank's traceback in the error); pytest-timeout (pyproject) is only the
  last resort.
* ``seeded`` seeds Python's, NumPy's and torch's generators for tests that draw random data.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from interlace.testing import netns_available

_NETNS_OK, _NETNS_REASON = netns_available()

#: Skip unless an emulated cluster can be built here (root, ip, tc, namespaces allowed).
requires_netns = pytest.mark.skipif(
    not _NETNS_OK, reason=f"needs network namespaces: {_NETNS_REASON}"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every test marked ``netns`` the :data:`requires_netns` skip condition."""
    for item in items:
        if item.get_closest_marker("netns") is not None:
            item.add_marker(requires_netns)


@pytest.fixture
def seeded() -> Iterator[int]:
    """Seed every random generator a test may touch with 0 (torch only if importable)."""
    seed = 0
    random.seed(seed)
    try:
        import numpy as np  # noqa: PLC0415 - only for the tests that ask for the fixture

        np.random.seed(seed)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    try:
        import torch  # noqa: PLC0415 - heavy; the launcher's tests run without it

        torch.manual_seed(seed)
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    yield seed
