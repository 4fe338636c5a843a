#!/usr/bin/env python3
"""Credentials for a Flower 1.42 deployment of fedcompress: TLS and SuperNode authentication.

``create`` writes into OUT (default ``docker/certs``)::

    ca.crt  ca.key                  a private certificate authority (ECDSA P-384, 10 years)
    server.pem  server.key          the SuperLink's TLS certificate, signed by the CA, valid for
                                    localhost, 127.0.0.1, ::1, ``superlink`` (the compose service)
                                    and every ``--san`` given (DNS names or IP addresses)
    keys/supernode-I  keys/supernode-I.pub
                                    one ECDSA P-384 key pair per SuperNode (I = 0 .. N-1), in the
                                    OpenSSH formats Flower expects: the private key for
                                    ``flower-supernode --auth-supernode-private-key``, the public
                                    key for ``flwr supernode register``
    keys/agent-I  keys/agent-I.pub  one P-384 key pair per site agent: the agent's SecAgg+
                                    signing key (its config's ``secagg-key``) and the public key
                                    every site's agent trusts (``secagg-peers``); never the
                                    SuperNode's, so the node-auth key signs nothing of a vote

and prints the registration commands. ``register`` runs ``flwr supernode register`` for each
public key given, against a SuperLink connection of ``$FLWR_HOME/config.toml``.

Flower 1.42 accepts only NIST elliptic-curve keys (P-256/P-384/P-521) for SuperNode
authentication; ed25519 keys are refused by both ``flwr supernode register`` and
``flower-supernode``.

    python docker/make_certs.py create docker/certs --nodes 3 --san superlink.example.org
    python docker/make_certs.py register --superlink deploy docker/certs/keys/supernode-*.pub
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import logging
import os
import secrets
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

logger = logging.getLogger("make_certs")

DEFAULT_NAMES = ("localhost", "127.0.0.1", "::1", "superlink")
CURVE = ec.SECP384R1
VALID_DAYS = 3650


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedcompress"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Write ``path`` atomically: a new file of a temporary name in the same folder (created
    with ``O_CREAT | O_EXCL | O_NOFOLLOW``, so never an existing file or a symlink's target),
    then ``os.replace``. A private key's file is created with mode 0600 (group and others never
    have any access, at no instant: no chmod after the write); a public file gets 0644."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = 0o600 if private else 0o644
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 mode)
    try:
        os.fchmod(fd, mode)  # the umask only removes bits; this sets exactly these
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(out: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(CURVE())
    now = dt.datetime.now(dt.timezone.utc)
    name = _name("fedcompress deployment CA")
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA384()))
    _write(out / "ca.crt", cert.public_bytes(serialization.Encoding.PEM))
    _write(out / "ca.key", _pem_key(key), private=True)
    return cert, key


def make_server_cert(out: Path, ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey,
                     names: list[str]) -> None:
    """The SuperLink's certificate: every name a client (SuperNode, SuperExec, flwr CLI) uses
    to reach it must be a subject alternative name."""
    key = ec.generate_private_key(CURVE())
    now = dt.datetime.now(dt.timezone.utc)
    ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (x509.CertificateBuilder().subject_name(_name(names[0])).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName([_general_name(n) for n in names]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False,
                                         crl_sign=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=True, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski),
                           critical=False)
            .sign(ca_key, hashes.SHA384()))
    _write(out / "server.pem", cert.public_bytes(serialization.Encoding.PEM))
    _write(out / "server.key", _pem_key(key), private=True)


def make_node_keys(keys_dir: Path, name: str) -> tuple[Path, Path]:
    """One SuperNode's key pair in OpenSSH format (what `ssh-keygen -t ecdsa -b 384` writes)."""
    key = ec.generate_private_key(CURVE())
    private = keys_dir / name
    public = keys_dir / f"{name}.pub"
    _write(private, key.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.OpenSSH,
                                      serialization.NoEncryption()), private=True)
    _write(public, key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                 serialization.PublicFormat.OpenSSH)
           + f" {name}\n".encode())
    return private, public


def create(out: Path, nodes: int, extra_names: list[str], prefix: str = "supernode",
           first: int = 0) -> dict:
    """CA, SuperLink certificate (if not there yet), ``nodes`` SuperNode key pairs and as many
    site-agent key pairs (``agent_keys``). Every private key file (``ca.key``, ``server.key``,
    ``keys/supernode-I``, ``keys/agent-I``) is created mode 0600 (:func:`_write`); ``OUT`` and
    ``OUT/keys`` are created mode 0700."""
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    (out / "keys").mkdir(exist_ok=True, mode=0o700)
    names = list(dict.fromkeys([*DEFAULT_NAMES, *extra_names]))
    if (out / "ca.crt").exists() and (out / "ca.key").exists():
        mode = stat.S_IMODE((out / "ca.key").lstat().st_mode)
        if (out / "ca.key").is_symlink() or mode & 0o077:
            raise SystemExit(f"{out / 'ca.key'}: the existing CA key is "
                             + ("a symbolic link" if (out / "ca.key").is_symlink()
                                else f"mode {mode:04o}, readable beyond its owner")
                             + ": not using it (chmod 600 it, or remove ca.crt and ca.key to "
                             "make a new CA)")
        logger.info("%s: keeping the existing CA", out)
        ca_cert = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
        ca_key = serialization.load_pem_private_key((out / "ca.key").read_bytes(), None)
    else:
        ca_cert, ca_key = make_ca(out)
    make_server_cert(out, ca_cert, ca_key, names)
    keys = [make_node_keys(out / "keys", f"{prefix}-{i}") for i in range(first, first + nodes)]
    agents = [make_node_keys(out / "keys", f"agent-{i}") for i in range(first, first + nodes)]
    return {"ca": out / "ca.crt", "cert": out / "server.pem", "key": out / "server.key",
            "names": names, "node_keys": keys, "agent_keys": agents}


def flwr_executable() -> str:
    """`flwr` next to this interpreter (a virtualenv), else on PATH."""
    local = Path(sys.executable).parent / "flwr"
    return str(local) if local.exists() else (shutil.which("flwr") or "flwr")


def register(public_keys: list[Path], superlink: str | None = None,
             env: dict | None = None, timeout: float = 60.0) -> list[int]:
    """Register SuperNode public keys with a running SuperLink (``flwr supernode register``);
    returns the node ids the SuperLink assigned."""
    import json

    node_ids = []
    for key in public_keys:
        command = [flwr_executable(), "supernode", "register", str(key)]
        if superlink:
            command.append(superlink)
        command += ["--format", "json"]
        proc = subprocess.run(command, capture_output=True, text=True, env=env,
                              timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(command)}` failed ({proc.returncode}):\n"
                               f"{proc.stdout}{proc.stderr}")
        reply = json.loads(proc.stdout[proc.stdout.index("{"):])
        if not reply.get("success"):
            raise RuntimeError(f"registering {key} failed: {reply}")
        node_ids.append(int(reply["node-id"]))
        logger.info("registered %s as SuperNode %s", key, reply["node-id"])
    return node_ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("create", help="CA, SuperLink certificate, SuperNode and site-agent "
                          "key pairs")
    make.add_argument("out", nargs="?", type=Path,
                      default=Path(__file__).resolve().parent / "certs")
    make.add_argument("--nodes", type=int, default=3, help="SuperNode key pairs (default 3)")
    make.add_argument("--first", type=int, default=0, help="index of the first key pair")
    make.add_argument("--san", action="append", default=[], metavar="NAME",
                      help="an extra DNS name or IP address of the SuperLink (repeatable)")
    reg = sub.add_parser("register", help="register SuperNode public keys with a SuperLink")
    reg.add_argument("public_keys", nargs="+", type=Path)
    reg.add_argument("--superlink", default=None,
                     help="connection name in $FLWR_HOME/config.toml (default: its default)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    if args.command == "register":
        register(args.public_keys, args.superlink, dict(os.environ))
        return 0

    made = create(args.out, args.nodes, args.san, first=args.first)
    out = args.out.resolve()
    logger.info("CA certificate:      %s", made["ca"])
    logger.info("SuperLink TLS:       %s, %s (names: %s)", made["cert"], made["key"],
                ", ".join(made["names"]))
    for private, public in made["node_keys"]:
        logger.info("SuperNode key pair:  %s, %s", private, public)
    for private, public in made["agent_keys"]:
        logger.info("site agent key pair: %s, %s", private, public)
    logger.info("\nOnce the SuperLink runs (with --enable-supernode-auth), register the "
                "SuperNodes' public keys:\n")
    for _, public in made["node_keys"]:
        logger.info("  flwr supernode register %s <connection>", public.resolve())
    logger.info("\nor: python %s register --superlink <connection> %s/keys/*.pub",
                Path(__file__).name, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
