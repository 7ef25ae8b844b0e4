"""Group tests reuse the daemon fixture (tests/service) and the ext_socket fixture of
tests/e2e (loaded from their conftest files by path); afdwin and criu_ok are shared by
tests/conftest.py."""

from __future__ import annotations

import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name, rel):
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, rel))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_e2e = _load("_cui_e2e_conftest", "../e2e/conftest.py")
_svc = _load("_cui_service_conftest", "../service/conftest.py")

ext_socket = _e2e.ext_socket
daemon = _svc.daemon
pki = _svc.pki
fake_job = _svc.fake_job
