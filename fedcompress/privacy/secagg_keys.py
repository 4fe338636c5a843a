"""The keys of SecAgg+ (:mod:`fedcompress.privacy.secagg`): the sites' long-term identities (a
PKI the server does not control: each site's own folder of the federation's public keys), the
per-vote P-384 key pairs, their agreement and channel, the plaintext of a pair of shares, what a
site signs, and a site's credentials from its own configuration. ``cryptography`` only, no
Flower."""

from __future__ import annotations

import base64
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedcompress.privacy.secagg_lanes import DOMAIN, SecAggError, pack_ints

CURVE = ec.SECP384R1()


def _public_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.X962,
                                         serialization.PublicFormat.UncompressedPoint)


def _load_public(data: bytes, what: str) -> ec.EllipticCurvePublicKey:
    try:
        return ec.EllipticCurvePublicKey.from_encoded_point(CURVE, bytes(data))
    except (ValueError, TypeError) as err:
        raise SecAggError(f"{what}: not a P-384 public key ({err})") from None


def _private_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _scalar_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    """A P-384 private key as its 48-byte scalar (what its Shamir shares carry)."""
    return key.private_numbers().private_value.to_bytes(48, "big")


def _key_from_scalar(data: bytes, what: str) -> ec.EllipticCurvePrivateKey:
    try:
        return ec.derive_private_key(int.from_bytes(bytes(data), "big"), CURVE)
    except (ValueError, TypeError) as err:
        raise SecAggError(f"{what}: not a P-384 private scalar ({err})") from None


def _load_private(data: bytes, what: str) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_der_private_key(data, password=None)
    except (ValueError, TypeError) as err:
        raise SecAggError(f"{what}: not a private key ({err})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise SecAggError(f"{what}: not an elliptic-curve private key")
    return key


def agree(private: ec.EllipticCurvePrivateKey, public: ec.EllipticCurvePublicKey) -> bytes:
    """32 bytes from an ECDH exchange: HKDF-SHA256 (no salt, no info) of the shared secret."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=None).derive(private.exchange(ec.ECDH(), public))


def _fernet(private: ec.EllipticCurvePrivateKey, public: ec.EllipticCurvePublicKey):

    from cryptography.fernet import Fernet

    return Fernet(base64.urlsafe_b64encode(agree(private, public)))


def _pack_shares(vote_id: bytes, src: int, dst: int, seed_share: bytes, key_share: bytes
                 ) -> bytes:
    """The plaintext of a pair of shares: the vote id (32 bytes), source and destination (8
    bytes each), the seed share's length (4 bytes), the seed share, the key share."""
    return (vote_id + src.to_bytes(8, "little") + dst.to_bytes(8, "little")
            + len(seed_share).to_bytes(4, "little") + seed_share + key_share)


def _unpack_shares(plain: bytes) -> tuple[bytes, int, int, bytes, bytes]:
    if len(plain) < 52:
        raise SecAggError("a share plaintext of fewer than 52 bytes")
    n = int.from_bytes(plain[48:52], "little")
    if 52 + n > len(plain):
        raise SecAggError("a share plaintext shorter than its seed share")
    return (plain[:32], int.from_bytes(plain[32:40], "little"),
            int.from_bytes(plain[40:48], "little"), plain[52:52 + n], plain[52 + n:])


# -- identities: the federation's long-term keys (a PKI the server does not control) -----------
def identity_public(key: ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey) -> bytes:
    """A long-term key's public point (X9.62 uncompressed): how a site names a peer."""
    public = key.public_key() if isinstance(key, ec.EllipticCurvePrivateKey) else key
    return public.public_bytes(serialization.Encoding.X962,
                               serialization.PublicFormat.UncompressedPoint)


def _check_p384(key, what: str) -> None:
    if not isinstance(key, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey) \
            or key.curve.name != CURVE.name:
        raise SecAggError(f"{what}: expected a P-384 (secp384r1) elliptic-curve key")


def load_identity(path: str | Path) -> ec.EllipticCurvePrivateKey:
    """This site's long-term signing key: a P-384 private key file, OpenSSH (what ``ssh-keygen
    -t ecdsa -b 384`` and the SuperNode node-auth keys are) or PEM, unencrypted."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise SecAggError(f"SecAgg identity key {str(path)!r}: {err.strerror}") from None
    key = None
    for loader in (serialization.load_ssh_private_key, serialization.load_pem_private_key):
        try:
            key = loader(data, None)
            break
        except (ValueError, TypeError, UnsupportedAlgorithm):
            continue
    if key is None:
        raise SecAggError(f"SecAgg identity key {str(path)!r}: not an unencrypted OpenSSH or "
                          "PEM private key")
    _check_p384(key, f"SecAgg identity key {str(path)!r}")
    return key  # type: ignore[return-value]


def load_public_key(data: bytes, what: str) -> ec.EllipticCurvePublicKey:
    """A P-384 public key, OpenSSH (``ecdsa-sha2-nistp384 AAAA... comment``) or PEM."""
    text = bytes(data).strip()
    try:
        key = (serialization.load_ssh_public_key(text.split(b"\n")[0]) if text.startswith(
            b"ecdsa-sha2-") else serialization.load_pem_public_key(text))
    except (ValueError, TypeError, UnsupportedAlgorithm) as err:
        raise SecAggError(f"{what}: not an OpenSSH or PEM public key ({err})") from None
    _check_p384(key, what)
    return key  # type: ignore[return-value]


def load_peers(folder: str | Path) -> dict[bytes, str]:
    """The federation's public keys (every ``*.pub`` in ``folder``, this site's own included)
    by their public point, each with its file name. A key in two files is refused (one
    identity, one site)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SecAggError(f"SecAgg peers folder {str(folder)!r} does not exist")
    peers: dict[bytes, str] = {}
    for path in sorted(folder.glob("*.pub")):
        point = identity_public(load_public_key(path.read_bytes(), f"peer key {path.name}"))
        if point in peers:
            raise SecAggError(f"peer keys {peers[point]} and {path.name} are the same key")
        peers[point] = path.name
    if not peers:
        raise SecAggError(f"SecAgg peers folder {str(folder)!r} holds no *.pub key")
    return peers


def _sign(key: ec.EllipticCurvePrivateKey, payload: bytes) -> bytes:
    return key.sign(payload, ec.ECDSA(hashes.SHA384()))


def _verifies(signer: bytes, signature: bytes, payload: bytes) -> bool:
    try:
        ec.EllipticCurvePublicKey.from_encoded_point(CURVE, signer).verify(
            bytes(signature), payload, ec.ECDSA(hashes.SHA384()))
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def _blob(b: bytes) -> bytes:
    return len(b).to_bytes(4, "little") + bytes(b)


def advert_payload(vote_id: bytes, index: int, c: bytes, s: bytes) -> bytes:
    """What a site signs at the keys stage: the vote, its index in the vote and both keys."""
    return DOMAIN + b"/advert/" + vote_id + int(index).to_bytes(8, "little") + _blob(c) + _blob(s)


def survivors_payload(vote_id: bytes, survivors: Iterable[int]) -> bytes:
    """What a survivor signs in the consistency round: the vote and the sorted survivor set."""
    return DOMAIN + b"/survivors/" + vote_id + pack_ints(sorted(int(n) for n in survivors))


class Advert(NamedTuple):
    """A site's keys stage: its channel and mask public keys, and (authenticated) their
    signature and the signer's long-term public key (empty: unauthenticated)."""

    c: bytes
    s: bytes
    signature: bytes = b""
    signer: bytes = b""


# -- a site's credentials, from its own configuration ------------------------------------------
def site_credentials(key: str, peers: str, simulation: bool
                     ) -> tuple[ec.EllipticCurvePrivateKey | None, dict[bytes, str] | None]:
    """This site's identity key and the federation's public keys, from the paths of its own
    configuration (node config ``secagg-key``, ``secagg-peers``); both or neither. Neither:
    unauthenticated SecAgg, allowed only in simulation (``simulation``: derived by the site,
    never from the server); elsewhere refused."""
    if key and peers:
        return load_identity(key), load_peers(peers)
    if key or peers:
        raise SecAggError(f"node config secagg-key={key!r} and secagg-peers={peers!r}: set "
                          "both (this site's P-384 private key and the folder of the "
                          "federation's *.pub keys) or neither")
    if not simulation:
        raise SecAggError("SecAgg+ outside the Simulation Engine needs authenticated sites: set "
                          "the node-config keys secagg-key (this site's P-384 private key, e.g. "
                          "its SuperNode auth key) and secagg-peers (the folder of the "
                          "federation's *.pub keys, this site's own included): refused")
    return None, None
