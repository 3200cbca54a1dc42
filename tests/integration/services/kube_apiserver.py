"""A real Kubernetes control plane for tests: etcd + kube-apiserver (1.20.2) on loopback, no scheduler or kubelet.

The kube-apiserver binary is built once by scripts/build-kube-apiserver.sh into
${MILES_LITE_CACHE:-/var/cache/miles-lite}/kube-apiserver/bin/kube-apiserver ($MILES_LITE_KUBE_APISERVER
overrides the path); etcd is Debian's etcd-server. Authentication is a static admin token, authorization
AlwaysAllow. Start-up takes about 6-12 s on 2 cores. Processes are stopped by their handles.

    build_apiserver()                  # runs the build script (minutes the first time)
    cp = start_control_plane(tmp_path) # ready when /readyz answers 200
    ... KUBECONFIG=cp.kubeconfig ...
    cp.stop()
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
BUILD_SCRIPT = REPO / "scripts" / "build-kube-apiserver.sh"
TOKEN = "miles-lite-test-token"


class ControlPlaneError(RuntimeError):
    """etcd or kube-apiserver did not come up; the message holds the log tail."""


def apiserver_binary() -> Path | None:
    """The cached kube-apiserver binary, or None when it has not been built."""
    explicit = os.environ.get("MILES_LITE_KUBE_APISERVER")
    cache = Path(os.environ.get("MILES_LITE_CACHE", "/var/cache/miles-lite"))
    path = Path(explicit) if explicit else cache / "kube-apiserver" / "bin" / "kube-apiserver"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def ready_apiserver() -> Path | None:
    """The binary, once there is one: while `scripts/test.sh` builds it in the background for a whole-suite run
    (it sets MILES_LITE_KUBE_APISERVER_BUILDING), the build's lock is waited for (a failed build fails here
    with its log). None when it is not built and no build runs."""
    if apiserver_binary() is None and os.environ.get("MILES_LITE_KUBE_APISERVER_BUILDING"):
        build_apiserver()
    return apiserver_binary()


def build_apiserver(timeout_s: float = 1800.0) -> Path:
    """Run scripts/build-kube-apiserver.sh (a no-op when the binary is cached) and return the binary path."""
    done = subprocess.run([str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise ControlPlaneError(f"{BUILD_SCRIPT} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "<no log>"


@dataclass
class ControlPlane:
    """A running etcd + kube-apiserver pair; `kubeconfig` points clients at it."""

    workdir: Path
    url: str
    kubeconfig: Path
    etcd: subprocess.Popen[bytes]
    apiserver: subprocess.Popen[bytes]

    def stop(self, timeout_s: float = 20.0) -> None:
        """Terminate kube-apiserver, then etcd (each by its own handle), killing what does not exit in time."""
        for proc in (self.apiserver, self.etcd):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=timeout_s)


def _ready(url: str) -> bool:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    req = urllib.request.Request(f"{url}/readyz", headers={"Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start_control_plane(workdir: Path, binary: Path | None = None, timeout_s: float = 90.0,
                        authorization: str = "AlwaysAllow") -> ControlPlane:
    """Start etcd and kube-apiserver with state under `workdir`; returns once /readyz is 200 (or raises).

    `authorization`: the API server's --authorization-mode (RBAC: roles are enforced; the admin token is in
    system:masters either way)."""
    binary = binary or apiserver_binary()
    etcd_bin = shutil.which("etcd")
    if binary is None or etcd_bin is None:
        raise ControlPlaneError(f"missing binaries: kube-apiserver={binary}, etcd={etcd_bin}; "
                                f"run {BUILD_SCRIPT}")
    workdir.mkdir(parents=True, exist_ok=True)
    sa_key = workdir / "sa.key"
    subprocess.run(["openssl", "genrsa", "-out", str(sa_key), "2048"], check=True, capture_output=True)
    (workdir / "tokens.csv").write_text(f'{TOKEN},admin,admin,"system:masters"\n')
    etcd_port, peer_port, api_port = _free_port(), _free_port(), _free_port()
    etcd_log = (workdir / "etcd.log").open("wb")
    etcd = subprocess.Popen(
        [etcd_bin, "--data-dir", str(workdir / "etcd-data"),
         "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
         "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-cluster", f"default=http://127.0.0.1:{peer_port}"],
        stdout=etcd_log, stderr=subprocess.STDOUT)
    api_log = (workdir / "apiserver.log").open("wb")
    apiserver = subprocess.Popen(
        [str(binary), f"--etcd-servers=http://127.0.0.1:{etcd_port}", f"--token-auth-file={workdir / 'tokens.csv'}",
         f"--secure-port={api_port}", "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
         f"--cert-dir={workdir / 'certs'}", "--service-account-issuer=https://kubernetes.default.svc",
         f"--service-account-key-file={sa_key}", f"--service-account-signing-key-file={sa_key}",
         "--service-cluster-ip-range=10.0.0.0/24", f"--authorization-mode={authorization}",
         "--disable-admission-plugins=ServiceAccount"],
        stdout=api_log, stderr=subprocess.STDOUT)
    url = f"https://127.0.0.1:{api_port}"
    kubeconfig = workdir / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: local, cluster: {{server: '{url}', insecure-skip-tls-verify: true}}}}]\n"
        "contexts: [{name: local, context: {cluster: local, user: admin, namespace: default}}]\n"
        f"users: [{{name: admin, user: {{token: {TOKEN}}}}}]\n"
        "current-context: local\n")
    cp = ControlPlane(workdir, url, kubeconfig, etcd, apiserver)
    deadline = time.monotonic() + timeout_s
    while not _ready(url):
        for name, proc in (("etcd", etcd), ("kube-apiserver", apiserver)):
            if proc.poll() is not None:
                cp.stop()
                log = workdir / ("etcd.log" if name == "etcd" else "apiserver.log")
                raise ControlPlaneError(f"{name} exited with {proc.returncode}:\n{_tail(log)}")
        if time.monotonic() > deadline:
            cp.stop()
            raise ControlPlaneError(f"kube-apiserver not ready after {timeout_s}s:\n{_tail(workdir / 'apiserver.log')}")
        time.sleep(0.2)
    return cp
