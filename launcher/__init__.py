"""The Kubernetes launcher of miles-lite: the MilesJob operator (kopf) and its pure renderer.

`render(body)` turns a MilesJob object into Kubernetes objects without I/O; `python -m launcher` runs the
operator that applies them, replaces failed rollout pods, restarts a failed trainer from its newest
checkpoint and keeps `status` current. See docs/kubernetes.md.
"""

from launcher.render import render
from launcher.spec import API_VERSION, GROUP, KIND, PLURAL, VERSION, JobSpec, SpecError, parse_job

__all__ = ["API_VERSION", "GROUP", "KIND", "PLURAL", "VERSION", "JobSpec", "SpecError", "parse_job", "render"]
