"""Test certificates made with the ``cryptography`` package (no ``openssl`` binary needed).

``make_pki(d, nodes=("server", "client"), strangers=("stranger",))`` writes into directory
``d``: a CA (``ca.crt``, ``ca.key``), one certificate and key per name in ``nodes`` signed by
it (``NAME.crt``, ``NAME.key``), a second CA (``other-ca.crt``, ``other-ca.key``) and one
certificate per name in ``strangers`` signed by that other CA. Every leaf certificate is
valid for 127.0.0.1, ::1 and localhost and for both server and client authentication (an
agent presents the same pair as a listener and as a group leader). Returns {file name: path}.
Keys are ECDSA P-256; certificates are valid from one hour ago for one day.
"""

from __future__ import annotations

import datetime
import ipaddress
import pathlib

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _validity(builder):
    now = datetime.datetime.now(datetime.timezone.utc)
    return builder.not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(
        now + datetime.timedelta(days=1)
    )


def _key_pem(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert_pem(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def make_ca(cn: str):
    """(certificate, key) of a self-signed CA named ``cn``."""
    key = ec.generate_private_key(ec.SECP256R1())
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
    )
    b = _validity(b).add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    b = b.add_extension(
        x509.KeyUsage(
            digital_signature=True,
            key_cert_sign=True,
            crl_sign=True,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            encipher_only=False,
            decipher_only=False,
        ),
        critical=True,
    )
    b = b.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    return b.sign(key, hashes.SHA256()), key


def issue(ca_cert, ca_key, cn: str):
    """(certificate, key) for ``cn`` signed by the CA: 127.0.0.1, ::1 and localhost; server
    and client authentication."""
    key = ec.generate_private_key(ec.SECP256R1())
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
    )
    b = _validity(b).add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    b = b.add_extension(
        x509.SubjectAlternativeName(
            [
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.IPAddress(ipaddress.ip_address("::1")),
                x509.DNSName("localhost"),
            ]
        ),
        critical=False,
    )
    b = b.add_extension(
        x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
        critical=False,
    )
    b = b.add_extension(
        x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
    )
    return b.sign(ca_key, hashes.SHA256()), key


def make_pki(d, nodes=("server", "client"), strangers=("stranger",)) -> dict:
    """Write the CA, ``nodes``' certificates, the other CA and ``strangers``' certificates
    into ``d`` (see the module docstring); returns {file name: absolute path}."""
    d = pathlib.Path(d)
    d.mkdir(parents=True, exist_ok=True)
    out = {}

    def write(name: str, data: bytes):
        p = d / name
        p.write_bytes(data)
        p.chmod(0o600)
        out[name] = str(p)

    for ca_name, leaves in (("ca", nodes), ("other-ca", strangers)):
        ca_cert, ca_key = make_ca(f"cuinterpose test {ca_name}")
        write(f"{ca_name}.crt", _cert_pem(ca_cert))
        write(f"{ca_name}.key", _key_pem(ca_key))
        for leaf in leaves:
            cert, key = issue(ca_cert, ca_key, leaf)
            write(f"{leaf}.crt", _cert_pem(cert))
            write(f"{leaf}.key", _key_pem(key))
    return out
