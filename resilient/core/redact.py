"""Secrets kept out of what a run writes down: command lines, launch records, incident bundles.

A command-line flag is taken for a secret when its name holds one of :data:`SECRET_WORDS` (``--api-token X``,
``--db-password=Y``, ``--aws-secret-access-key Z``), unless it names where a secret is kept
(:data:`PLACES`: ``--token-file PATH``, ``--key-path``, ``--secret-dir``).  Its value is replaced by
:data:`REDACTED` in what is written; the values themselves can be scrubbed from any text with :func:`scrub`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

SECRET_WORDS = ("password", "passwd", "secret", "token", "credential", "key")
"""A flag or setting whose name holds one of these carries a secret."""
PLACES = ("file", "path", "dir")
"""...unless its name ends with one of these: it says where the secret is, not what it is."""
REDACTED = "<redacted>"
PASSWORD_ENV = "RESILIENT_ETCD_PASSWORD"
"""Where ``resilient run`` takes the etcd password from; no worker's environment has it."""


def secret_name(name: str) -> bool:
    """Whether a flag or setting called ``name`` carries a secret (see the module doc)."""
    words = name.lower().lstrip("-").replace("-", "_")
    return any(w in words for w in SECRET_WORDS) and not any(words.endswith(p) for p in PLACES)


def _flag(arg: str) -> str | None:
    return arg.split("=", 1)[0] if arg.startswith("-") and len(arg) > 1 else None


def secret_values(argv: Sequence[str]) -> list[str]:
    """The values of ``argv``'s secret flags (``--name VALUE`` and ``--name=VALUE``)."""
    found: list[str] = []
    for i, arg in enumerate(argv):
        name = _flag(arg)
        if name is None or not secret_name(name):
            continue
        if "=" in arg:
            found.append(arg.split("=", 1)[1])
        elif i + 1 < len(argv) and _flag(argv[i + 1]) is None:
            found.append(argv[i + 1])
    return [v for v in found if v]


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with every secret flag's value replaced by :data:`REDACTED`."""
    out = list(argv)
    for i, arg in enumerate(argv):
        name = _flag(arg)
        if name is None or not secret_name(name):
            continue
        if "=" in arg:
            out[i] = f"{name}={REDACTED}"
        elif i + 1 < len(argv) and _flag(argv[i + 1]) is None:
            out[i + 1] = REDACTED
    return out


def scrub(data: bytes, secrets: Iterable[str], label: str = REDACTED) -> bytes:
    """``data`` with every occurrence of each secret (of at least 4 characters: shorter ones would hit ordinary
    text) replaced by ``label``; the longest first, so that a secret inside another is not left half shown."""
    for secret in sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True):
        data = data.replace(secret.encode(), label.encode())
    return data
