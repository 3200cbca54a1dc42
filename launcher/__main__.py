"""`python -m launcher`: run the MilesJob operator.

    python -m launcher [-n NAMESPACE ...] [--interval 10] [--job-image IMAGE] [--liveness http://0.0.0.0:8080/healthz]

Without --namespace it watches every namespace. Credentials: the pod's service account in a cluster,
else $KUBECONFIG / ~/.kube/config. Jobs without spec.image get --job-image, by default the operator's own
image (read from its pod, named by $POD_NAMESPACE/$POD_NAME), or NAME:TAG-gpu of it for jobs with GPUs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import kopf

from launcher.handlers import build_registry, build_settings
from launcher.kube import KubeApi, load_api_client
from launcher.reconcile import OperatorConfig, Reconciler


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line arguments of the operator."""
    p = argparse.ArgumentParser(prog="python -m launcher", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--namespace", action="append", default=[], help="namespace to watch (repeatable)")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between reconcile passes of a job")
    p.add_argument("--job-image", default=None,
                   help="image for jobs without spec.image (default: the operator pod's own image)")
    p.add_argument("--step-metric", default="miles_lite_step", help="trainer gauge holding the optimizer step")
    p.add_argument("--checkpoint-metric", default="miles_lite_checkpoint_step",
                   help="trainer gauge holding the step of the newest checkpoint")
    p.add_argument("--liveness", default=None, help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.interval <= 0:
        p.error(f"--interval must be positive seconds, got {args.interval}")
    return args


def own_image(api: KubeApi, container: str = "operator") -> str | None:
    """The image of this operator's container, when it runs in a pod that $POD_NAMESPACE/$POD_NAME name."""
    namespace, name = os.environ.get("POD_NAMESPACE"), os.environ.get("POD_NAME")
    if not namespace or not name:
        return None
    pod = api.get("v1", "Pod", namespace, name)
    images = [c["image"] for c in ((pod or {}).get("spec") or {}).get("containers") or [] if c["name"] == container]
    return images[0] if images else None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the operator until interrupted; returns the exit code."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api = KubeApi(load_api_client())
    job_image = args.job_image or own_image(api)
    logging.getLogger("launcher").info("default job image: %s", job_image or "none (jobs must set spec.image)")
    config = OperatorConfig(interval_s=args.interval, job_image=job_image, step_metric=args.step_metric,
                            checkpoint_metric=args.checkpoint_metric)
    reconciler = Reconciler(api, config)
    kopf.run(registry=build_registry(reconciler), settings=build_settings(), standalone=True,
             clusterwide=not args.namespace, namespaces=args.namespace, liveness_endpoint=args.liveness)
    return 0


if __name__ == "__main__":
    sys.exit(main())
