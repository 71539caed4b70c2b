"""Token proofs on the store keys that change a run: who may stop it, end it, or spend its restarts.

A control store is shared infrastructure: anyone who can write etcd can
write ``/resilient/<run>/...``.  Writes that change a run (a stop request, a
verdict, a restart record, the launch record) therefore carry a proof,
``HMAC-SHA256(run token, key NUL canonical JSON of the value)``, and readers
ignore entries whose proof is missing or wrong.  Binding the key means a
proof cannot be replayed under another key (another launch's verdict, say).

Every value that steers a run carries one: the launch and recovery keys
(:class:`SignedStore`, keys relative to the run's root), the rendezvous
rounds and the nodes' presence, accusations and vouches (:class:`Seal`, over
the full etcd keys with the proof bound to the part under the run's root,
so a value proves the same wherever it is read from).  A key that names its
generation or launch binds the proof to them too: a value copied to another
generation's key, or an older launch's, does not verify.

The token is the run's secret (``<run_dir>/token``); every agent of a run
must hold the same one.  :func:`token_fingerprint` (an HMAC of a fixed label,
which reveals nothing about the token) is published once per run, so an
agent started with a different token finds out at start, not by having its
writes ignored.

:class:`SignedStore` wraps a :class:`ControlStore` with these rules; it
reports each rejected entry once through ``on_rejected`` (the agent's
``forged_key`` event).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .keyspace import TOKEN_FINGERPRINT
from .store import ControlStore, Entry

VERIFIED_KEPT = 16384
"""Entries whose proof a :class:`SignedStore` remembers having checked (a launch's recovery keys, its pool and
its presence: a few per node), so that a watch's view read again after one key changed costs no second check of
the others."""
_FINGERPRINT_LABEL = b"resilient run token fingerprint v1"

RejectCallback = Callable[[str, str], None]
"""Called with (key, problem) once per rejected entry revision."""


def _mac(token: str, key: str, body: str) -> str:
    return hmac.new(token.encode(), key.encode() + b"\0" + body.encode(), hashlib.sha256).hexdigest()


def _canonical(value: dict[str, Any]) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def sign(token: str, key: str, value: dict[str, Any]) -> bytes:
    """The stored form of ``value`` under ``key``: ``{"body": value, "proof": hmac}`` as JSON."""
    return json.dumps({"body": value, "proof": _mac(token, key, _canonical(value))}).encode()


@dataclass(frozen=True)
class Checked:
    """A stored entry after its proof was checked: ``value`` when valid, else ``problem`` says why not."""

    value: dict[str, Any] | None
    problem: str | None


def verify(token: str, key: str, raw: bytes) -> Checked:
    """Check the proof of ``raw`` as stored under ``key``; whatever ``raw`` holds, it answers (never raises)."""
    try:
        wrapper = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return Checked(None, "not JSON (or nested too deep to read)")
    if not isinstance(wrapper, dict) or not isinstance(wrapper.get("body"), dict):
        return Checked(None, "no signed body (written without the run token?)")
    proof = wrapper.get("proof")
    if not isinstance(proof, str) or not proof.isascii():
        return Checked(None, "no proof (written without the run token)")
    try:
        expected = _mac(token, key, _canonical(wrapper["body"]))
    except (ValueError, RecursionError):
        return Checked(None, "a body that cannot be read back (nested too deep)")
    if not hmac.compare_digest(proof.encode(), expected.encode()):
        return Checked(None, "wrong proof (written with another token, or altered)")
    return Checked(wrapper["body"], None)


def token_fingerprint(token: str) -> str:
    """An HMAC of a fixed label: equal for equal tokens, and says nothing about the token."""
    return hmac.new(token.encode(), _FINGERPRINT_LABEL, hashlib.sha256).hexdigest()


class Seal:
    """Signs values for etcd keys under ``root`` and checks what is read back, remembering what checked; thread-safe.

    The proof is bound to the key with ``root`` cut off (the run's keys as :class:`SignedStore` names them).
    ``on_rejected(key, problem)`` is called once per rejected revision of a key."""

    def __init__(self, token: str, root: str = "", on_rejected: RejectCallback | None = None) -> None:
        self._token = token
        self.root = root
        self._on_rejected = on_rejected
        self._reported: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        self._good: OrderedDict[tuple[str, int, bytes], dict[str, Any]] = OrderedDict()
        """Values whose proof checked, by (key, revision, raw value): the newest VERIFIED_KEPT."""

    def _name(self, key: str) -> str:
        if not key.startswith(self.root):
            raise ValueError(f"key {key!r} is outside the run's keys {self.root!r}")
        return key[len(self.root):]

    def seal(self, key: str, value: dict[str, Any]) -> bytes:
        """The stored form of ``value`` under ``key`` (a full key, under ``root``)."""
        return sign(self._token, self._name(key), value)

    def open(self, entry: Entry) -> dict[str, Any] | None:
        """The value of ``entry`` if its proof holds; None (reported once) if not."""
        memo = (entry.key, entry.mod_revision, entry.value)
        with self._lock:
            known = self._good.get(memo)
            if known is not None:
                self._good.move_to_end(memo)
                return known
        checked = (verify(self._token, entry.key[len(self.root):], entry.value) if entry.key.startswith(self.root)
                   else Checked(None, "outside the run's keys"))
        if checked.value is not None:
            with self._lock:
                self._good[memo] = checked.value
                if len(self._good) > VERIFIED_KEPT:
                    self._good.popitem(last=False)
            return checked.value
        if checked.problem is not None:
            with self._lock:
                first = (entry.key, entry.mod_revision) not in self._reported
                self._reported.add((entry.key, entry.mod_revision))
            if first and self._on_rejected is not None:
                self._on_rejected(entry.key, checked.problem)
        return None

    def opened(self, entries: Iterable[Entry]) -> dict[str, dict[str, Any]]:
        """key -> value of the entries whose proof holds (the others reported and left out)."""
        found = {}
        for entry in entries:
            value = self.open(entry)
            if value is not None:
                found[entry.key] = value
        return found


class SignedStore:
    """The proof-carrying view of a :class:`ControlStore` (keys as in the store); thread-safe."""

    def __init__(self, store: ControlStore, token: str, on_rejected: RejectCallback | None = None) -> None:
        self.store = store
        self._token = token
        self.seal = Seal(token, "", on_rejected)
        """Signs and checks values under the store's keys (relative to the run's root)."""

    def _check(self, entry: Entry) -> dict[str, Any] | None:
        return self.seal.open(entry)

    def get(self, key: str) -> dict[str, Any] | None:
        """The verified value under ``key``; ``None`` when absent or its proof fails (reported)."""
        found = self.store.get(key)
        return None if found is None else self._check(found)

    def get_entry(self, key: str) -> tuple[Entry | None, dict[str, Any] | None]:
        """The raw entry (for its revision) and its verified value (``None`` if absent or rejected)."""
        found = self.store.get(key)
        return found, (None if found is None else self._check(found))

    def verified(self, entries: Iterable[Entry]) -> dict[str, dict[str, Any]]:
        """Verified values of ``entries`` (read elsewhere, e.g. by a watch; keys as in the store), rejected ones
        reported and left out."""
        return self.seal.opened(entries)

    def get_prefix(self, prefix: str, only: Callable[[str], bool] | None = None) -> dict[str, dict[str, Any]]:
        """Verified values of the keys under ``prefix`` (those ``only`` accepts); rejected ones are reported."""
        found = {}
        for entry in self.store.get_prefix(prefix):
            if only is not None and not only(entry.key):
                continue
            value = self._check(entry)
            if value is not None:
                found[entry.key] = value
        return found

    def put(self, key: str, value: dict[str, Any]) -> int:
        """Write a signed ``value`` under ``key``, whatever is there; returns the store's revision."""
        return self.store.put(key, sign(self._token, key, value))

    def put_if_absent(self, key: str, value: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
        """Create ``key`` unless a verified value is there: ``(True, value)`` or ``(False, the existing value)``.

        An entry without a valid proof does not count as present: it is replaced,
        so a forged key cannot block the real one.
        """
        signed = sign(self._token, key, value)
        while True:
            created, entry = self.store.put_if_absent(key, signed)
            if created:
                return True, value
            existing = self._check(entry)
            if existing is not None:
                return False, existing
            swapped, _ = self.store.compare_and_swap(key, entry.mod_revision, signed)
            if swapped:
                return True, value

    def compare_and_swap(self, key: str, expected_mod_revision: int, value: dict[str, Any]) -> tuple[bool, Entry | None]:
        """Write a signed ``value`` if ``key`` is still at ``expected_mod_revision`` (0: absent)."""
        return self.store.compare_and_swap(key, expected_mod_revision, sign(self._token, key, value))

    def check_fingerprint(self, *, publish: bool = True) -> str | None:
        """Compare this token's fingerprint with the run's (publishing it first if none): ``None`` or the problem."""
        mine = token_fingerprint(self._token)
        if publish:
            _, entry = self.store.put_if_absent(TOKEN_FINGERPRINT, mine.encode())
        else:
            found = self.store.get(TOKEN_FINGERPRINT)
            if found is None:
                return "the run has published no token fingerprint (no agent of it started)"
            entry = found
        if entry.value.decode(errors="replace") == mine:
            return None
        return "another agent of this run uses a different run token"
