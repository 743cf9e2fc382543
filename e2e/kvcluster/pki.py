"""Certificates and the kubeconfig, made with the `openssl` command line.

One CA; one certificate (O=system:masters, SANs for 127.0.0.1, localhost and the
kubernetes.default names) that serves the API, authenticates every client and the front proxy;
one RSA key pair that signs service-account tokens. Created once per state directory.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

SANS = (
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
    "IP:127.0.0.1",
    "IP:10.96.0.1",
)


class PkiError(RuntimeError):
    """openssl is missing or failed."""


@dataclass(frozen=True)
class Pki:
    """Paths of the files `ensure_pki` writes."""

    ca_cert: Path  # trust anchor for clients and servers
    ca_key: Path
    admin_cert: Path  # serving + client + front-proxy certificate, O=system:masters
    admin_key: Path
    sa_key: Path  # signs service-account tokens
    sa_pub: Path  # verifies them

    @classmethod
    def under(cls, pki_dir: Path) -> Pki:
        return cls(*(pki_dir / name for name in _FILES))


_FILES = ("ca.crt", "ca.key", "admin.crt", "admin.key", "sa.key", "sa.pub")


def ensure_pki(pki_dir: Path) -> Pki:
    pki = Pki.under(pki_dir)
    if all(path.is_file() for path in vars(pki).values()):
        return pki
    openssl = shutil.which("openssl")
    if openssl is None:
        raise PkiError("cannot create certificates: `openssl` is not on PATH")
    pki_dir.mkdir(parents=True, exist_ok=True)
    (pki_dir / "admin.ext").write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
        f"subjectAltName={','.join(SANS)}\n"
    )
    steps = [
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650",
         "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=kvfleet-e2e-ca",
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", "admin.key", "-out", "admin.csr",
         "-subj", "/O=system:masters/CN=kvfleet-admin"],
        ["x509", "-req", "-in", "admin.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
         "-CAcreateserial", "-days", "3650", "-out", "admin.crt", "-extfile", "admin.ext"],
        ["genrsa", "-out", "sa.key", "2048"],
        ["rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub"],
    ]  # fmt: skip
    for args in steps:
        result = subprocess.run(
            [openssl, *args], cwd=pki_dir, capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise PkiError(f"openssl {args[0]} failed in {pki_dir}: {result.stderr.strip()}")
    return pki


def render_kubeconfig(pki: Pki, server: str) -> str:
    """A self-contained kubeconfig (certificates embedded) for user kvfleet-admin."""

    def b64(path: Path) -> str:
        return base64.b64encode(path.read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "kvfleet-e2e",
                "cluster": {"server": server, "certificate-authority-data": b64(pki.ca_cert)},
            }
        ],
        "users": [
            {
                "name": "kvfleet-admin",
                "user": {
                    "client-certificate-data": b64(pki.admin_cert),
                    "client-key-data": b64(pki.admin_key),
                },
            }
        ],
        "contexts": [
            {"name": "kvfleet-e2e", "context": {"cluster": "kvfleet-e2e", "user": "kvfleet-admin"}}
        ],
        "current-context": "kvfleet-e2e",
    }
    return yaml.safe_dump(config, sort_keys=False)
