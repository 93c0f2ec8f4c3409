"""The primitives secure aggregation uses, all from the `cryptography` package (the `secure` extra), none
written here: X25519 key agreement, HKDF-SHA256 key derivation, ChaCha20 to expand a 32-byte seed into a
mask, ChaCha20-Poly1305 to encrypt the shares one device sends another through the coordinator.

Every key is derived for one purpose and one (round, sender, receiver): a share's key and nonce are never
used twice, and a mask seed is never a share key.
"""

from __future__ import annotations

import functools
import hashlib
from types import SimpleNamespace

from edgefed.errors import ConfigError

KEY_BYTES = 32  # X25519 keys, mask seeds, ChaCha20 keys
TAG_BYTES = 16  # Poly1305
_NONCE = bytes(12)  # every AEAD key encrypts one message only
_STREAM_NONCE = bytes(16)  # every ChaCha20 key expands one mask only


@functools.cache
def _library() -> SimpleNamespace:
    """The parts of `cryptography` used here, imported once (a missing package is a one-line ConfigError)."""
    try:
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import x25519
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
        from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError:
        raise ConfigError("config: [secagg] enabled = true needs the cryptography package; "
                          "install it with pip install 'edgefed[secure]'") from None
    return SimpleNamespace(InvalidTag=InvalidTag, hashes=hashes, serialization=serialization, x25519=x25519,
                           Cipher=Cipher, algorithms=algorithms, ChaCha20Poly1305=ChaCha20Poly1305, HKDF=HKDF)


def available() -> None:
    """Raise the one-line ConfigError naming the extra when `cryptography` is missing."""
    _library()


def public_key(private: bytes) -> bytes:
    """The X25519 public key of a 32-byte private key."""
    lib = _library()
    key = lib.x25519.X25519PrivateKey.from_private_bytes(private).public_key()
    return key.public_bytes(lib.serialization.Encoding.Raw, lib.serialization.PublicFormat.Raw)


def agree(private: bytes, peer_public: bytes, info: bytes) -> bytes:
    """HKDF-SHA256 of the X25519 shared secret, for the purpose `info` names: 32 bytes."""
    lib = _library()
    shared = lib.x25519.X25519PrivateKey.from_private_bytes(private).exchange(
        lib.x25519.X25519PublicKey.from_public_bytes(peer_public))
    return lib.HKDF(algorithm=lib.hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(shared)


STREAM_SLACK = 64  # update_into's output must exceed its input by up to a ChaCha20 block


def expand_into(seed: bytes, zeros: bytes, out) -> None:
    """ChaCha20's keystream under a 32-byte seed (the mask a seed stands for) into the first len(zeros) bytes
    of out (len(zeros) + STREAM_SLACK bytes, reused: nothing is allocated per mask)."""
    lib = _library()
    lib.Cipher(lib.algorithms.ChaCha20(seed, _STREAM_NONCE), mode=None).encryptor().update_into(zeros, out)


def seal(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """ChaCha20-Poly1305 under a key used for this one message: ciphertext and tag."""
    return _library().ChaCha20Poly1305(key).encrypt(_NONCE, plaintext, associated)


def open_sealed(key: bytes, ciphertext: bytes, associated: bytes) -> bytes | None:
    """The plaintext, or None when the ciphertext, its tag or the associated data were changed."""
    lib = _library()
    try:
        return lib.ChaCha20Poly1305(key).decrypt(_NONCE, ciphertext, associated)
    except lib.InvalidTag:
        return None


def commit(seed: bytes) -> bytes:
    """SHA-256 of a self-mask seed, published with the keys so a seed rebuilt from shares can be checked."""
    return hashlib.sha256(b"edgefed secagg self-mask" + seed).digest()
