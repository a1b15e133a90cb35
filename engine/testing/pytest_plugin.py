"""pytest plugin of the conformance kit: ``--engine-platform NAME`` and its fixtures.

Registered through the ``pytest11`` entry point (``engine =
"engine.testing.pytest_plugin"``); without it, load it with
``-p engine.testing.pytest_plugin``.
"""

from __future__ import annotations

import os

import pytest

PLATFORM_OPTION = "--engine-platform"
PLATFORM_ENV = "ENGINE_TEST_PLATFORM"  # the option's default when set


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("engine", "engine plugin conformance kit")
    group.addoption(
        PLATFORM_OPTION,
        action="store",
        dest="engine_platform",
        default=os.environ.get(PLATFORM_ENV, "cpu"),
        help="platform name (or 'auto') the conformance checks run against "
             f"(default: ${PLATFORM_ENV} or 'cpu')",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "conformance(clause): a plugin conformance check of contract clause(s)"
    )
    config.addinivalue_line(
        "markers", "multi_device: a conformance check that needs two devices of the platform"
    )


def pytest_report_header(config: pytest.Config) -> str:
    return f"engine conformance kit: platform {config.getoption('engine_platform')!r}"


@pytest.fixture(scope="session")
def engine_platform_name(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("engine_platform")


@pytest.fixture(scope="session")
def engine_platform(engine_platform_name: str):
    """The Platform instance ``--engine-platform`` names, resolved like ``--device``."""
    from engine.core.plugins import resolve_platform

    try:
        return resolve_platform(engine_platform_name)
    except ValueError as exc:
        pytest.fail(f"[platform.resolve] cannot resolve --engine-platform "
                    f"{engine_platform_name!r}: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def engine_device(engine_platform):
    return engine_platform.device()
