"""Certificates and keys for the local control plane, made with the openssl CLI.

One CA signs everything. The API server's serving certificate names every
address a client may use (127.0.0.1, localhost, the in-cluster service IP and
DNS names); the admin client certificate carries O=system:masters, the group
RBAC always allows, so the control-plane components and the test harness can
share it. A separate RSA key pair signs and verifies service-account tokens.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SERVICE_IP = "10.96.0.1"  # first address of --service-cluster-ip-range
API_SANS = (
    "IP:127.0.0.1",
    f"IP:{SERVICE_IP}",
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
)


class PkiError(RuntimeError):
    """openssl is missing or refused to make a certificate."""


@dataclass(frozen=True)
class Pki:
    dir: Path

    @property
    def ca_crt(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    @property
    def server_crt(self) -> Path:
        return self.dir / "apiserver.crt"

    @property
    def server_key(self) -> Path:
        return self.dir / "apiserver.key"

    @property
    def admin_crt(self) -> Path:
        return self.dir / "admin.crt"

    @property
    def admin_key(self) -> Path:
        return self.dir / "admin.key"

    @property
    def sa_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"


def _openssl(*args: str | Path) -> None:
    result = subprocess.run(["openssl", *map(str, args)], capture_output=True, text=True)
    if result.returncode != 0:
        raise PkiError(f"openssl {args[0]} failed: {result.stderr.strip()}")


def _sign(pki: Pki, name: str, subject: str, extensions: str, days: int = 30) -> None:
    key, csr, crt = pki.dir / f"{name}.key", pki.dir / f"{name}.csr", pki.dir / f"{name}.crt"
    ext = pki.dir / f"{name}.ext"
    ext.write_text(extensions)
    _openssl("genrsa", "-out", key, "2048")
    _openssl("req", "-new", "-key", key, "-subj", subject, "-out", csr)
    _openssl("x509", "-req", "-in", csr, "-CA", pki.ca_crt, "-CAkey", pki.ca_key,
             "-CAcreateserial", "-days", str(days), "-sha256", "-extfile", ext, "-out", crt)


def make_pki(directory: Path) -> Pki:
    """Create the CA, serving and client certificates and the SA key pair."""
    if shutil.which("openssl") is None:
        raise PkiError("openssl is not installed; install it (Debian: apt-get install openssl)")
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory)
    _openssl("genrsa", "-out", pki.ca_key, "2048")
    _openssl("req", "-x509", "-new", "-key", pki.ca_key, "-subj", "/CN=kvmesh-local-ca",
             "-days", "30", "-sha256", "-out", pki.ca_crt,
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature")
    _sign(pki, "apiserver", "/CN=kube-apiserver",
          "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
          "extendedKeyUsage=serverAuth\nsubjectAltName=" + ",".join(API_SANS) + "\n")
    _sign(pki, "admin", "/O=system:masters/CN=kvmesh-admin",
          "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
          "extendedKeyUsage=clientAuth\n")
    _openssl("genrsa", "-out", pki.sa_key, "2048")
    _openssl("rsa", "-in", pki.sa_key, "-pubout", "-out", pki.sa_pub)
    return pki
