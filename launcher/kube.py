"""A small typed door to the Kubernetes REST API for the kinds the operator manages.

Objects are plain dicts (what the renderer produces and the API server returns). The REST path of
a kind comes from a fixed table (no discovery round trips); an unknown kind is a programming error.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from launcher.spec import API_VERSION, KIND, PLURAL

PLURALS: dict[str, str] = {
    "ConfigMap": "configmaps",
    "Service": "services",
    "Pod": "pods",
    "Job": "jobs",
    "PodGroup": "podgroups",
    "Secret": "secrets",
    "NetworkPolicy": "networkpolicies",
    KIND: PLURAL,
}


class Conflict(RuntimeError):
    """HTTP 409: the object exists already (a predecessor still being deleted), or a write conditioned on a
    resourceVersion found the object changed since."""


class Refused(ValueError):
    """The API server refused an object as invalid (HTTP 400 or 422); the message is the server's."""

    def __init__(self, kind: str, name: str, message: str):
        self.kind = kind
        self.name = name
        super().__init__(f"the API server refuses {kind} {name}: {message}")


def _server_message(err: ApiException) -> str:
    try:
        return str(json.loads(err.body or "{}").get("message") or err.reason)
    except ValueError:
        return str(err.body or err.reason)


def load_api_client() -> client.ApiClient:
    """An authenticated client: in-cluster service account when inside a pod, else $KUBECONFIG / ~/.kube/config."""
    try:
        config.load_incluster_config()
        return client.ApiClient()
    except config.ConfigException:
        cfg = client.Configuration()
        config.load_kube_config(client_configuration=cfg)
        return client.ApiClient(configuration=cfg)


def object_path(api_version: str, kind: str, namespace: str, name: str | None = None,
                subresource: str | None = None) -> str:
    """REST path of a namespaced object (or of its collection when `name` is None)."""
    if kind not in PLURALS:
        raise KeyError(f"kind {kind!r} is not managed by the operator; known kinds: {sorted(PLURALS)}")
    prefix = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{PLURALS[kind]}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


class KubeApi:
    """get / list / create / merge-patch / delete of namespaced objects, as dicts."""

    def __init__(self, api_client: client.ApiClient):
        self._client = api_client

    @property
    def configuration(self) -> client.Configuration:
        """Server address and credentials of this client."""
        return self._client.configuration

    def _call(self, method: str, path: str, body: Any = None, query: list[tuple[str, str]] | None = None,
              content_type: str = "application/json") -> Any:
        """One request; the JSON answer as dicts. Raises ApiException for a non-2xx status."""
        headers = {"Accept": "application/json", "Content-Type": content_type}
        method, url, headers, _, _ = self._client.param_serialize(
            method, path, query_params=query or [], header_params=headers, auth_settings=["BearerToken"])
        resp = self._client.call_api(method, url, header_params=headers, body=body, _request_timeout=30)
        resp.read()
        text = resp.data.decode("utf-8") if resp.data else ""
        if not 200 <= resp.status <= 299:
            raise ApiException.from_response(http_resp=resp, body=text, data=None)
        return json.loads(text) if text else {}

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return self._call("GET", object_path(api_version, kind, namespace, name))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        """Objects of `kind` in `namespace` carrying all of `labels`."""
        sel = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        out = self._call("GET", object_path(api_version, kind, namespace), query=[("labelSelector", sel)])
        return list(out.get("items") or [])

    def create(self, obj: Mapping[str, Any], dry_run: bool = False) -> dict[str, Any]:
        """Create `obj` in its metadata.namespace; raises Conflict when the name is taken, Refused when the
        server finds it invalid. `dry_run`: the server validates it and stores nothing (a taken name is then
        reported after validation, so Conflict means the object itself is valid)."""
        meta = obj["metadata"]
        query = [("dryRun", "All")] if dry_run else None
        try:
            return self._call("POST", object_path(obj["apiVersion"], obj["kind"], meta["namespace"]), body=obj,
                              query=query)
        except ApiException as err:
            if err.status == 409:
                raise Conflict(f"{obj['kind']} {meta['namespace']}/{meta['name']} already exists") from err
            if err.status in (400, 422):
                raise Refused(obj["kind"], meta["name"], _server_message(err)) from err
            raise

    def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: Mapping[str, Any],
              subresource: str | None = None) -> dict[str, Any]:
        """JSON merge patch (RFC 7386) of an object or of its `subresource` (e.g. status). A patch that names
        `metadata.resourceVersion` applies only to that version: Conflict when the object changed since."""
        try:
            return self._call("PATCH", object_path(api_version, kind, namespace, name, subresource), body=patch,
                              content_type="application/merge-patch+json")
        except ApiException as err:
            if err.status == 409:
                raise Conflict(f"{kind} {namespace}/{name} changed since it was read: {_server_message(err)}") \
                    from err
            raise

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete with background propagation (children follow); False when it was already gone."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        try:
            self._call("DELETE", object_path(api_version, kind, namespace, name), body=body)
            return True
        except ApiException as err:
            if err.status == 404:
                return False
            raise

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The MilesJob `namespace/name`, or None."""
        return self.get(API_VERSION, KIND, namespace, name)
