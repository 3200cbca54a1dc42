"""kopf wiring: which events run which reconciler step. No module-level state: `build_registry` makes a fresh
registry bound to one Reconciler, so tests and the entry point each run their own operator.

- create / resume / spec update, and a timer every `OperatorConfig.interval_s` -> `Reconciler.reconcile` (apply
  the newest valid spec, heal failed pods and trainer, write the status)
- delete -> `Reconciler.mark_terminating` (phase Terminating while the MilesJob goes)
Per-job locks keep passes from interleaving on one MilesJob (kopf runs timers beside change handlers), and
each pass writes its status before it releases the lock, so the next pass reads it.
"""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime
from typing import Any

import kopf

from launcher.reconcile import Reconciler
from launcher.spec import GROUP, PLURAL, VERSION


def utc_now() -> str:
    """The current time in RFC 3339 (seconds, UTC), as Kubernetes writes timestamps."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class _JobLocks:
    """One lock per MilesJob uid."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}

    def get(self, uid: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(uid, threading.Lock())

    def forget(self, uid: str) -> None:
        with self._guard:
            self._locks.pop(uid, None)


def build_settings() -> kopf.OperatorSettings:
    """kopf settings: state in annotations (the API server prunes unknown status fields), no peering objects."""
    settings = kopf.OperatorSettings()
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.peering.standalone = True
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    return settings


def build_registry(reconciler: Reconciler) -> kopf.OperatorRegistry:
    """A kopf registry whose handlers drive `reconciler` for every MilesJob."""
    registry = kopf.OperatorRegistry()
    locks = _JobLocks()
    resource = (GROUP, VERSION, PLURAL)

    @kopf.on.login(registry=registry)
    def login_fn(**_: Any) -> kopf.ConnectionInfo:
        # kopf watches with the credentials the reconciler writes with (a fresh registry has no
        # default login handlers). The token is read on each login, so rotated tokens are picked up.
        cfg = reconciler.api.configuration
        header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization") or ""
        scheme, _, token = header.rpartition(" ")
        return kopf.ConnectionInfo(
            server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
            scheme=scheme or None, token=token or None,
            certificate_path=cfg.cert_file, private_key_path=cfg.key_file,
        )

    def run_pass(body: kopf.Body) -> None:
        # The pass writes the status itself, inside the lock: kopf would write a returned status after the
        # handler, outside it, where the next pass could read the job first and overwrite what this one counted.
        with locks.get(body["metadata"]["uid"]):
            reconciler.reconcile(body, utc_now())

    # A new or edited spec is reconciled at once (the pass decides whether and how an edit is applied).
    @kopf.on.resume(*resource, registry=registry)
    @kopf.on.create(*resource, registry=registry)
    @kopf.on.update(*resource, field="spec", registry=registry)
    def apply_fn(body: kopf.Body, **_: Any) -> None:
        run_pass(body)

    @kopf.timer(*resource, interval=reconciler.config.interval_s, initial_delay=reconciler.config.interval_s,
                registry=registry)
    def reconcile_fn(body: kopf.Body, **_: Any) -> None:
        run_pass(body)

    @kopf.on.delete(*resource, registry=registry, optional=True)
    def forget_fn(body: kopf.Body, **_: Any) -> None:
        # Children go with the MilesJob through their ownerReferences; until it is gone its status says so.
        uid = body["metadata"]["uid"]
        with locks.get(uid):
            reconciler.mark_terminating(body, utc_now())
        locks.forget(uid)

    return registry
