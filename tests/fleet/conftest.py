"""Fleet fixtures: real nginx in front of real tritonserver replicas on loopback (free ports).

A missing nginx *fails* the tests with the install command (``apt-get install -y nginx-light``), as a
missing ``nvidia-pytriton`` fails the serving tests: a skipped fleet test must never read as a passing one.
"""

from __future__ import annotations

import pytest

from ..serving.conftest import BUNDLED, _need_serving_deps

FAIL_TIMEOUT_S = 2  # nginx skips a replica that refused a connection for this long (test: short)
IDLE_S = 300.0  # sequences outlive the module: a replica keeps a moved session's old state (stale-state tests)


def require_nginx() -> str:
    """The nginx binary, or fail the test with the install command (never skip)."""
    from toktier_backend.deploy.fleet import find_nginx

    try:
        return find_nginx()
    except FileNotFoundError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two replicas of our repository (bundled GPT-2) behind nginx; tests may kill, restart and add replicas."""
    _need_serving_deps()
    require_nginx()
    from toktier_backend.deploy.fleet import Fleet

    f = Fleet(str(BUNDLED), 2, http_port=0, grpc_port=0, log_dir=tmp_path_factory.mktemp("fleet"),
              fail_timeout_s=FAIL_TIMEOUT_S, session_idle_s=IDLE_S, exit_timeout_s=2)
    try:
        f.start(240)
    except RuntimeError as e:
        pytest.fail(str(e))
    yield f
    f.stop()
